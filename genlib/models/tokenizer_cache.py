"""transformers' tokenizer of a model folder, kept on disk as it was built, so that a later
start encodes and decodes without importing transformers (about 0.6 s of a start).

    tokenizer = cached_tokenizer(folder, build)   # build() -> transformers' tokenizer, or None

The first load runs `build()` (transformers' own class and `from_pretrained`) and writes
what it built to `<user cache dir>/genlab/tokenizers/<entry>.json`: the `tokenizers`
object transformers configured (normalizer, pre-tokenizer, model, added tokens,
post-processor, decoder, serialized by `tokenizers` itself), its special token ids and its
chat template. Later loads rebuild that object with `tokenizers` and serve it through
`CachedTokenizer`, which answers what a generation asks of a tokenizer the way
transformers' `TokenizersBackend` does (encode, decode, ids to tokens, the vocabulary,
special ids) and hands anything else to transformers' tokenizer, loaded then.

Only a tokenizer whose Python layer adds nothing to those answers is kept: transformers'
`TokenizersBackend` or `LlamaTokenizer` (which only builds the object differently),
decoding without transformers' clean-up of spaces, and giving the same ids and texts
from the rebuilt object on a set of probe texts. Everything the kept answers depend on
keys the entry: the folder, a SHA-256 of each of its files a tokenizer may be built
from (`.json`, `.jinja`, `.txt`, `.model`, `.tiktoken`; a file rewritten within the file
system's timestamp resolution still counts), and the versions of transformers and
tokenizers; a stale, damaged or unreadable entry is built again. The
file is written whole (a temporary file, then a rename); a cache directory that cannot be
written only costs the next start the import.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

FORMAT = 1
SUFFIX = ".json"
# The key hashes every file of the folder (and of its chat templates' folder) of a kind
# transformers may read for a tokenizer: configs, vocabularies, merges, sentencepiece and
# tiktoken models, templates. Weights and other large files are never read.
TOKENIZER_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
TEMPLATES = "additional_chat_templates"
KEPT_CLASSES = ("TokenizersBackend", "LlamaTokenizer")
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
PROBES = ("Hello, world! def f(x):\n    return x  # done\n\n\tTabs\r\nand  double  spaces ",
          "a , b . c ? d ! don 't , it' s",
          " leading space", "Ünïcödé ✓ 日本語 🙂", "", "\n\n\n", "a" * 40)


def directory() -> Path:
    from genlib import cachedirs

    return cachedirs.tokenizers()


def cached_tokenizer(folder: Path, build: Callable[[], Any]) -> Any:
    """The tokenizer of `folder`: a CachedTokenizer from its cache entry where one is
    current, else `build()`'s (None where it fails), kept for next time where it can be."""
    key = _key(folder)
    path = directory() / f"{_entry(folder)}{SUFFIX}"
    kept = _read(path, key)
    if kept is not None:
        try:
            return CachedTokenizer(kept, build)
        except Exception:  # noqa: BLE001  (tokenizers refuses a damaged entry: build again)
            pass
    tokenizer = build()
    if tokenizer is not None:
        try:
            state = _state(tokenizer, key)
        except Exception:  # noqa: BLE001  (whatever it is: transformers' tokenizer serves)
            state = None
        try:
            if state is not None:
                _write(path, state)
            else:
                path.unlink(missing_ok=True)  # an entry of the folder's former files
        except OSError:
            pass  # the next start builds it again
    return tokenizer


class CachedTokenizer:
    """A tokenizer rebuilt from its cache entry (see the module doc): `full` is
    transformers' own, loaded on first use, which answers every other attribute."""

    def __init__(self, state: dict[str, Any], build: Callable[[], Any]) -> None:
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(state["tokenizer"])
        self._backend.encode_special_tokens = bool(state["split_special_tokens"])
        self._build = build
        self._full: Any = None
        self.chat_template: str | None = state["chat_template"]
        self.all_special_ids: list[int] = list(state["all_special_ids"])
        for name in SPECIAL:
            setattr(self, name, state[name])

    @property
    def full(self) -> Any:
        """transformers' tokenizer of the folder (loaded now, the first time)."""
        if self._full is None:
            self._full = self._build()
            if self._full is None:
                raise RuntimeError("transformers could not load a tokenizer it loaded before")
        return self._full

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_backend", "_build", "_full"):
            raise AttributeError(name)
        return getattr(self.full, name)

    def __call__(self, text: Any, *more: Any, add_special_tokens: bool = True,
                 **kwargs: Any) -> Any:
        if more or kwargs or not isinstance(text, str):
            return self.full(text, *more, add_special_tokens=add_special_tokens, **kwargs)
        return {"input_ids": self._encode(text, add_special_tokens)}

    def encode(self, text: Any, *more: Any, add_special_tokens: bool = True,
               **kwargs: Any) -> Any:
        if more or kwargs or not isinstance(text, str):
            return self.full.encode(text, *more, add_special_tokens=add_special_tokens,
                                    **kwargs)
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding[0].ids)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> Any:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(ids, int):
            ids = [ids]
        batched = isinstance(ids, (list, tuple)) and bool(ids) and \
            isinstance(ids[0], (list, tuple))
        if kwargs or batched or clean_up_tokenization_spaces or \
                not isinstance(ids, (list, tuple)):
            return self.full.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                                    **kwargs)
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __bool__(self) -> bool:
        return True


def _state(tokenizer: Any, key: dict[str, Any]) -> dict[str, Any] | None:
    """What a cache entry keeps of `tokenizer`, or None unless it can be kept (the module
    doc: its class, no clean-up of spaces, the probes)."""
    from tokenizers import Tokenizer

    if type(tokenizer).__name__ not in KEPT_CLASSES or \
            type(tokenizer).__module__.split(".")[0] != "transformers":
        return None
    if _cleans_up(tokenizer):
        return None
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()  # transformers encodes without either unless asked
    backend.no_padding()
    template = tokenizer.chat_template
    state = {"format": FORMAT, "key": key, "tokenizer": backend.to_str(),
             "split_special_tokens": bool(tokenizer.split_special_tokens),
             "chat_template": template if isinstance(template, str) else None,
             "all_special_ids": [int(i) for i in tokenizer.all_special_ids],
             **{name: getattr(tokenizer, name) for name in SPECIAL}}
    if not all(v is None or isinstance(v, int) for v in (state[n] for n in SPECIAL)):
        return None
    if template is not None and not isinstance(template, str):
        return None
    return state if _agrees(tokenizer, CachedTokenizer(state, lambda: tokenizer)) else None


def _cleans_up(tokenizer: Any) -> bool:
    """Whether transformers' decode cleans up spaces by default: never for a BPE model,
    unless told to even so."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    return type(tokenizer.backend_tokenizer.model).__name__ != "BPE" or bool(getattr(
        tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
        False))


def _agrees(tokenizer: Any, kept: CachedTokenizer) -> bool:
    """Whether the rebuilt tokenizer answers as transformers' does on the probes."""
    special = [t for t in tokenizer.all_special_tokens if isinstance(t, str)]
    for text in (*PROBES, " ".join(special), "x".join(special)):
        for add in (True, False):
            ids = list(tokenizer(text, add_special_tokens=add)["input_ids"])
            if kept(text, add_special_tokens=add)["input_ids"] != ids or \
                    kept.encode(text, add_special_tokens=add) != \
                    list(tokenizer.encode(text, add_special_tokens=add)):
                return False
            for skip in (True, False):
                if kept.decode(ids, skip_special_tokens=skip) != \
                        tokenizer.decode(ids, skip_special_tokens=skip):
                    return False
            if kept.convert_ids_to_tokens(ids) != tokenizer.convert_ids_to_tokens(ids):
                return False
    return len(kept) == len(tokenizer) and kept.get_vocab() == tokenizer.get_vocab()


def _key(folder: Path) -> dict[str, Any]:
    """Everything a cache entry depends on (see the module doc)."""
    files = {}
    for path in sorted(_files(folder)):
        try:
            files[path.relative_to(folder).as_posix()] = \
                hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            continue
    return {"format": FORMAT, "folder": str(folder.resolve()), "files": files,
            "transformers": _version("transformers"), "tokenizers": _version("tokenizers")}


def _files(folder: Path) -> list[Path]:
    """The folder's files a tokenizer may be built from, and its additional chat
    templates."""
    found: list[Path] = []
    for place in (folder, folder / TEMPLATES):
        try:
            found += [p for p in place.iterdir() if p.is_file() and
                      p.name.endswith(TOKENIZER_SUFFIXES)]
        except OSError:
            continue
    return found


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _entry(folder: Path) -> str:
    """The entry's file name: the folder's path, hashed."""
    return hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]


def _read(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The entry at `path` when it is whole and was kept for `key`."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(state, dict) or state.get("key") != key or \
            state.get("format") != FORMAT or not _valid(state):
        return None
    return state


def _valid(state: dict[str, Any]) -> bool:
    ids: Sequence[Any] = state.get("all_special_ids", None) or []
    return isinstance(state.get("tokenizer"), str) and \
        isinstance(state.get("all_special_ids"), list) and \
        all(isinstance(i, int) for i in ids) and \
        isinstance(state.get("split_special_tokens"), bool) and \
        (state.get("chat_template") is None or isinstance(state["chat_template"], str)) and \
        all(name in state and (state[name] is None or isinstance(state[name], int))
            for name in SPECIAL)


def _write(path: Path, state: dict[str, Any]) -> None:
    """The entry, written whole under a temporary name and renamed into place."""
    from genlib.cachedirs import written_whole

    with written_whole(path) as file:
        file.write(json.dumps(state).encode("utf-8"))


@dataclass(frozen=True)
class Entry:
    """One cache entry, as `genlab cache list` shows it: the model folder it was built
    from (None where unreadable), and whether that folder's tokenizer files changed
    since (or went)."""

    path: Path
    size: int
    folder: str | None
    stale: bool


def entries() -> list[Entry]:
    """Every cache entry."""
    folder = directory()
    if not folder.is_dir():
        return []
    return [_entry_of(path) for path in sorted(folder.glob(f"*{SUFFIX}"))]


def _entry_of(path: Path) -> Entry:
    try:
        key = json.loads(path.read_text(encoding="utf-8")).get("key", {})
        source = key.get("folder")
    except (OSError, ValueError, AttributeError, RecursionError):
        key, source = {}, None
    if not isinstance(source, str):
        return Entry(path, _size(path), None, True)
    return Entry(path, _size(path), source, key != _key(Path(source)))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def leftovers() -> list[Path]:
    """Temporary files of writes that never finished."""
    folder = directory()
    return sorted(folder.glob(f".*{SUFFIX}.*.tmp")) if folder.is_dir() else []
