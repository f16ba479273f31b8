"""Grammar-constrained generation through xgrammar: a JSON schema, a regular expression
or an EBNF/GBNF grammar becomes the chain's first stage, "grammar", which sets the logit
of every token the grammar cannot take next to -inf.

    compiled = grammar.compile_for(lm.tokenizer, lm.vocab_size, lm.eos_ids, settings)
    chain = processors.build_processors(settings, constraint=compiled, ...)

The stage is a pure function of the context: each row's generated tokens (the columns
of `token_ids` from `prompt_width` on) select a grammar matcher, kept in a small cache
keyed by those tokens and made by forking the matcher one token shorter. So greedy,
sampled, batched, beam and speculative decoding all use it unchanged: beams that share
a prefix share its matcher, and a speculative verification that looks at several draft
positions at once finds each position's matcher from the one before.

xgrammar is the optional `grammar` extra (pip install 'genlab[grammar]'); without it the
grammar settings fail with a ConfigError saying how to install it, and everything else
works.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from genlib.errors import ConfigError, GenlabWarning, GrammarTimeoutError
from genlib.sampling import bounded, grammar_cache

INCOMPLETE = "grammar_incomplete"  # the finish reason of output the grammar would not end
# The finish reason of output that ended where the grammar allowed it, yet fails its JSON
# schema: xgrammar's mask does not enforce every keyword (allOf, not, multipleOf, ...).
INVALID = "schema_invalid"
NEG_INF = float("-inf")
CACHE_SIZE = 512  # matchers kept; a step needs one per row (per position when speculating)
# The CLI's spinner: given what is compiling, a context that shows it while it lasts.
Notify = Callable[[str], contextlib.AbstractContextManager[None]]


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ConfigError("json_schema, regex and grammar need xgrammar: "
                          "pip install 'genlab[grammar]'") from None
    return xgrammar


def kind_of(settings: Any) -> str | None:
    """Which constraint the settings give: 'json_schema', 'regex', 'grammar' or None."""
    for key in ("json_schema", "regex", "grammar"):
        if getattr(settings, key, None) is not None:
            return key
    return None


@dataclass(frozen=True)
class _Tokenizer:
    """xgrammar's view of a tokenizer, and the hash of its content (the cache keys)."""

    info: Any
    digest: str


# Per tokenizer object (not its id(), which a later object can reuse), per vocab size and
# end ids: building one decodes the whole vocabulary.
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], _Tokenizer]] = \
    weakref.WeakKeyDictionary()
_COMPILED: OrderedDict[str, Any] = OrderedDict()  # cache key -> grammar compiled here
COMPILED_KEPT = 16  # grammars kept in memory (a batch's lines, compare's columns)
QUIET_S = 0.5  # a compile that takes longer is announced (`notify`)


def _tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> _Tokenizer:
    """xgrammar's view of the tokenizer (built once per tokenizer: it decodes the vocab)."""
    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, tuple(eos_ids))
    if key not in per_tokenizer:
        info = _xgrammar().TokenizerInfo.from_huggingface(  # transformers' own tokenizer
            getattr(tokenizer, "full", tokenizer), vocab_size=vocab_size,
            stop_token_ids=list(eos_ids) or None)
        per_tokenizer[key] = _Tokenizer(info, grammar_cache.tokenizer_digest(info))
    return per_tokenizer[key]


KIND_NAMES = {"json_schema": "JSON schema", "regex": "regex", "grammar": "EBNF"}


def compile_for(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], settings: Any,
                notify: Notify | None = None) -> CompiledGrammar | None:
    """The settings' constraint compiled for this tokenizer (None without one): from
    memory, from the disk cache (`genlib.sampling.grammar_cache`), or compiled on a worker thread
    that Ctrl-C and SIGTERM interrupt. ConfigError when xgrammar is missing or cannot
    read the schema, regex or grammar; GrammarTimeoutError past settings.grammar_timeout.
    `notify(message)`: a context the compile runs in when it takes longer than QUIET_S
    (the CLI's spinner)."""
    kind = kind_of(settings)
    if kind is None:
        return None
    text = getattr(settings, kind)
    view = _tokenizer(tokenizer, vocab_size, eos_ids)
    name = grammar_cache.key(kind, text, view.digest)
    if name in _COMPILED:
        _warn(kind, _COMPILED[name][1])  # as its compile did
    else:
        about = (f"compiling {KIND_NAMES[kind]} grammar ({len(text.encode()):,} bytes) for "
                 f"{_tokenizer_name(tokenizer)}")
        _COMPILED[name] = _compiled(name, kind, text, view.info, settings.grammar_timeout,
                                    lambda: notify(about) if notify else contextlib.nullcontext())
    _COMPILED.move_to_end(name)
    while len(_COMPILED) > COMPILED_KEPT:
        _COMPILED.popitem(last=False)
    compiled = _COMPILED[name][0]
    return CompiledGrammar(compiled, _schema_check(tokenizer, text)
                           if kind == "json_schema" else None)


def _tokenizer_name(tokenizer: Any) -> str:
    path = str(getattr(tokenizer, "name_or_path", "") or "")
    return os.path.basename(path.rstrip("/")) or type(tokenizer).__name__


def _compiled(name: str, kind: str, text: str, info: Any, limit_s: float,
              shown: Callable[[], contextlib.AbstractContextManager[None]]
              ) -> tuple[Any, tuple[str, ...]]:
    """(xgrammar's compiled grammar, the warnings its compile logged): from the disk
    cache, or compiled now and stored there when reading it back will pay."""
    entry = grammar_cache.load(name, info)
    if entry is not None:
        _warn(kind, entry.warnings)
        return entry.compiled, entry.warnings
    compiler = _xgrammar().GrammarCompiler(info, max_threads=1, cache_enabled=False)
    started = time.monotonic()
    with _xgrammar_warnings(kind) as messages:
        compiled = _bounded_compile(compiler, kind, text, limit_s, shown)
    compile_s = time.monotonic() - started
    if grammar_cache.worth_storing(compiled, compile_s):
        # serializing takes about as long as compiling did: on a worker too, interruptible
        bounded.run(lambda: grammar_cache.store(name, compiled, messages, compile_s),
                    math.inf)
    return compiled, tuple(messages)


def _bounded_compile(compiler: Any, kind: str, text: str, limit_s: float,
                     shown: Callable[[], contextlib.AbstractContextManager[None]]) -> Any:
    """`text` compiled by `compiler` on a worker thread (genlib.sampling.bounded)."""
    call = {"json_schema": lambda: compiler.compile_json_schema(text, any_whitespace=False),
            "regex": lambda: compiler.compile_regex(text),
            "grammar": lambda: compiler.compile_grammar(text)}[kind]
    try:
        return bounded.run(call, limit_s, QUIET_S, shown)
    except bounded.OutOfTime:
        raise GrammarTimeoutError(
            f"the {kind} grammar took longer than {limit_s:g} s to compile; raise "
            f"--grammar-timeout (grammar_timeout in a preset), or make the "
            f"{KIND_NAMES[kind]} smaller") from None
    except (RuntimeError, ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{kind} cannot be compiled: {_first_line(exc)}") from None


# A line of xgrammar's C++ log: "[08:14:16] /path/fsm_builder.cc:1237: Warning: ...".
_LOG_LINE = re.compile(rb"^\[[^\]]*\]\s*\S+\.(?:cc|h):\d+:\s*Warning:\s*(.*)$")
# File descriptor 2 is the process's: one capture at a time, or a second thread's would
# save the first one's log as "stderr" and put it back for good.
_CAPTURE = threading.Lock()


@contextlib.contextmanager
def _xgrammar_warnings(kind: str) -> Iterator[list[str]]:
    """Turn what xgrammar's C++ code logs on file descriptor 2 meanwhile (a part of the
    constraint it ignores or does not enforce, stamped with the time and its own source
    path) into one GenlabWarning per distinct message, naming the setting; the list
    yielded gets those messages, to keep with the compiled grammar. Anything else
    written there meanwhile (another thread's) is written back after it, in its order.
    When the compile fails, everything captured is written back as it was. Without a
    stderr, or a temporary file to capture into, nothing is captured."""
    messages: list[str] = []
    with _CAPTURE:
        log, saved = _redirect_stderr()
        if log is None:
            yield messages
            return
        with log:
            try:
                yield messages
            except BaseException:
                _restore_stderr(saved)
                _write_back(_read(log))
                raise
            _restore_stderr(saved)
            messages += _pass_on(_read(log), kind)


def _flush_stderr() -> None:
    if sys.stderr is not None:  # None when started with 2>&-
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()


def _redirect_stderr() -> tuple[Any, int]:
    """(a temporary file now on file descriptor 2, a copy of what was there), or
    (None, -1) where either cannot be had."""
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:
        return None, -1
    try:
        log = tempfile.TemporaryFile()
        os.dup2(log.fileno(), 2)
    except OSError:
        os.close(saved)
        return None, -1
    return log, saved


def _restore_stderr(saved: int) -> None:
    try:
        _flush_stderr()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _read(log: Any) -> bytes:
    log.seek(0)
    return log.read()


def _write_back(data: bytes) -> None:
    with contextlib.suppress(OSError):  # a stderr whose reader went away
        while data:
            data = data[os.write(2, data):]


def _pass_on(captured: bytes, kind: str) -> list[str]:
    """The lines of `captured` that are not xgrammar's warnings back on file descriptor
    2, then each distinct warning as a GenlabWarning (`_warn`); those warnings' messages."""
    lines = captured.splitlines(keepends=True)
    found = [_LOG_LINE.match(line.rstrip(b"\r\n")) for line in lines]
    _write_back(b"".join(line for line, match in zip(lines, found) if match is None))
    messages = [match.group(1).decode("utf-8", "replace").strip() for match in found if match]
    messages = list(dict.fromkeys(messages))
    _warn(kind, messages)
    return messages


def _warn(kind: str, messages: Sequence[str]) -> None:
    """Each of xgrammar's `messages` as a GenlabWarning naming the setting. Python shows
    a warning once per text and place: this one place, so once per process (a REPL, a
    batch, compare's columns), whether the grammar was compiled or read from a cache."""
    for message in messages:
        warnings.warn(GenlabWarning(f"{kind}: xgrammar warns: {message}"), stacklevel=1)


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled for one tokenizer, and for a JSON schema `valid`: whether a
    finished output's tokens are an instance of it, which the mask alone cannot promise
    (xgrammar leaves some keywords unenforced)."""

    grammar: Any
    valid: Callable[[Sequence[int]], bool] | None = None


def _schema_check(tokenizer: Any, schema_text: str) -> Callable[[Sequence[int]], bool]:
    """The schema's validator (jsonschema's, for the schema's own draft) over decoded
    tokens. It resolves no remote reference: jsonschema retrieves none unless asked."""
    import jsonschema

    schema = json.loads(schema_text)
    validator = jsonschema.validators.validator_for(schema)(schema)

    def valid(tokens: Sequence[int]) -> bool:
        text = tokenizer.decode(list(tokens), skip_special_tokens=True)
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return False
        return bool(validator.is_valid(value))

    return valid


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its '[time] file.cc:line:' prefix."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)


@dataclass
class Matchers:
    """xgrammar matchers keyed by the generated tokens they have accepted.

    The common case, a row one token further than at the last step, advances its
    matcher in place (one `accept_token`), and `moved` remembers where that matcher went;
    a key needed again later (a second beam from one parent, a speculative rollback) is
    rebuilt by forking the matcher it moved to and rolling that fork back."""

    compiled: Any
    cache: OrderedDict[tuple[int, ...], Any]  # key -> its matcher (None: not allowed)
    moved: OrderedDict[tuple[int, ...], tuple[int, ...]]  # key -> the longer key it became
    valid: Callable[[Sequence[int]], bool] | None = None  # CompiledGrammar.valid

    @classmethod
    def start(cls, constraint: CompiledGrammar) -> Matchers:
        root = _xgrammar().GrammarMatcher(constraint.grammar)
        return cls(constraint.grammar, OrderedDict({(): root}), OrderedDict(),
                   constraint.valid)

    def observe(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Nothing to do: matchers are found from the context itself."""

    def reorder(self, index: torch.Tensor) -> None:
        """Nothing to do: matchers are keyed by tokens, not by row."""

    def get(self, generated: tuple[int, ...]) -> Any | None:
        """The matcher after `generated`; None when the grammar does not allow it."""
        if generated in self.cache:
            self.cache.move_to_end(generated)
            return self.cache[generated]
        parent = generated[:-1]
        if parent and self.cache.get(parent) is not None:  # the root is never moved
            matcher = self.cache.pop(parent)
            if _accept(matcher, generated[-1:]):
                self._store(generated, matcher)
                self.moved[parent] = generated
                while len(self.moved) > CACHE_SIZE:
                    self.moved.popitem(last=False)
                return matcher
            self._store(parent, matcher)  # a refused token leaves the matcher as it was
            self._store(generated, None)
            return None
        for cut in range(len(generated) - 1, -1, -1):
            found, matcher = self._copy_of(generated[:cut])
            if found:
                break
        if matcher is not None and not _accept(matcher, generated[cut:]):
            matcher = None
        self._store(generated, matcher)
        return matcher

    def _copy_of(self, key: tuple[int, ...]) -> tuple[bool, Any | None]:
        """(found, a fresh matcher after `key`, or None if the grammar forbids key)."""
        if key in self.cache:
            matcher = self.cache[key]
            return True, None if matcher is None else matcher.fork()
        owner = key
        while owner in self.moved:
            owner = self.moved[owner]
        if owner != key and self.cache.get(owner) is not None:
            matcher = self.cache[owner].fork()
            matcher.rollback(len(owner) - len(key))
            return True, matcher
        return False, None

    def _store(self, key: tuple[int, ...], matcher: Any | None) -> None:
        self.cache[key] = matcher
        while len(self.cache) > CACHE_SIZE:
            oldest = next(iter(self.cache))
            if oldest == ():
                self.cache.move_to_end(oldest)  # the root stays: everything forks from it
                continue
            self.cache.pop(oldest)

    def allows(self, generated: tuple[int, ...], token: int) -> bool:
        """Whether the grammar can take `token` after `generated`."""
        return self.get((*generated, token)) is not None

    def complete(self, generated: tuple[int, ...]) -> bool:
        """Whether `generated` is a whole sentence of the grammar."""
        matcher = self.get(generated)
        return matcher is not None and (matcher.is_terminated() or matcher.is_completed())


def _accept(matcher: Any, tokens: Sequence[int]) -> bool:
    """Feed `tokens` to `matcher`; False at the first one the grammar refuses."""
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(token):
            return False
    return True


def _row_tokens(row: list[int], prompt_width: int) -> tuple[int, ...]:
    """The generated tokens of one context row (no padding follows the prompt)."""
    return tuple(row[prompt_width:])


def mask_fn(matchers: Matchers, prompt_width: int) -> Any:
    """The grammar stage's processor over `matchers`."""
    xgr = _xgrammar()
    scratch: dict[tuple[int, int], torch.Tensor] = {}  # bitmask buffers, reused per shape

    def constrain(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """grammar: l[x] = -inf for every x the grammar cannot take next."""
        rows = token_ids.tolist()
        shape = (len(rows), logits.shape[-1])
        if shape not in scratch:
            scratch[shape] = xgr.allocate_token_bitmask(*shape)
        bitmask = scratch[shape]
        for i, row in enumerate(rows):
            matcher = matchers.get(_row_tokens(row, prompt_width))
            if matcher is None or matcher.is_terminated():
                bitmask[i].zero_()  # a context the grammar rejects: nothing can follow
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        allowed = _allowed(bitmask, shape[1]).to(logits.device)
        return torch.where(allowed, logits, torch.tensor(NEG_INF, dtype=logits.dtype,
                                                         device=logits.device))

    return constrain


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed bitmask (bit j of int32 word i = token 32 i + j) as booleans;
    numpy's unpackbits is several times faster here than xgrammar's CPU kernel."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))


def finish_reason(matchers: Matchers | None, generated: Sequence[int], reason: str) -> str:
    """`reason`, unless the row ran out of tokens or time before its grammar could end
    (INCOMPLETE), or ended where the grammar allowed yet fails its JSON schema (INVALID):
    output that is not valid is never taken for valid output."""
    if matchers is None or reason not in ("eos", "length", "time"):
        return reason
    if reason != "eos" and not matchers.complete(tuple(generated)):
        return INCOMPLETE
    if matchers.valid is not None and not matchers.valid(generated):
        return INVALID
    return reason


def valid_prefix(matchers: Matchers, generated: Sequence[int], draft: Sequence[int]) -> int:
    """How many of `draft`'s tokens the grammar allows after `generated`, each leaving
    something to follow (speculative decoding drops the rest before verifying: the target
    could never accept them, and it scores the position after every draft token, which
    the grammar's end leaves without a single allowed token)."""
    done = tuple(generated)
    for n, token in enumerate(draft):
        done = (*done, token)
        matcher = matchers.get(done)
        if matcher is None or matcher.is_terminated():
            return n
    return len(draft)
