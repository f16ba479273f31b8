"""genlib.models.tokenizer_cache: a model folder's tokenizer, kept after its first load,
answers every later start exactly as transformers' tokenizer does, without importing
transformers; a changed, damaged or unwritable cache never changes an answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from typer.testing import CliRunner

from genlib.models import tokenizer_cache
from genlib.models.loading import DEFAULT_MODEL, ModelSpec, load_model
from genlib.models.quickload import _transformers_tokenizer
from genlib.models.tokenizer_cache import CachedTokenizer, cached_tokenizer
from tests.conftest import CODE_TARGET, LLAMA2XS, ROOT, STORIES

MODELS = [STORIES, LLAMA2XS, CODE_TARGET, DEFAULT_MODEL]
TEXTS = ["Once upon a time", " leading space", "two\n\nlines  and  spaces", "",
         "def f(x):\n    return x * 2\n", "ünïcödé 😀 日本語", "a\tb\r\nc", "</s> and <s> inline",
         "<|endoftext|>print(1)", "<|user|>\nhi<|end|>\n", "  \n\t  "]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cache" / "tokenizers"
    monkeypatch.setattr(tokenizer_cache, "directory", lambda: folder)
    return folder


def load_twice(path: Path):
    """The quick load of `path` from an empty cache, then again from its entry."""
    if not path.is_dir():
        pytest.skip(f"{path} is not present")
    spec = ModelSpec(str(path))
    return load_model(spec, quick=True), load_model(spec, quick=True)


def tokenizer_folder(tmp_path: Path, source: Path = CODE_TARGET) -> Path:
    """A folder with `source`'s tokenizer files alone (a tokenizer needs no weights)."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def load(folder: Path):
    declared = json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
    return cached_tokenizer(folder, partial(_transformers_tokenizer, folder, declared))


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_a_second_start_answers_as_transformers_tokenizer(path, cache_dir):
    first, second = load_twice(path)
    full = first.tokenizer
    assert not isinstance(full, CachedTokenizer) and len(list(cache_dir.iterdir())) == 1
    kept = second.tokenizer
    assert isinstance(kept, CachedTokenizer) and kept._full is None
    assert (second.eos_ids, second.pad_id, second.vocab_size) == \
        (first.eos_ids, first.pad_id, first.vocab_size)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids", "chat_template", "vocab_size"):
        assert getattr(kept, name) == getattr(full, name), name
    assert len(kept) == len(full) and kept.get_vocab() == full.get_vocab()
    every_id = list(range(len(full)))
    assert kept.convert_ids_to_tokens(every_id) == full.convert_ids_to_tokens(every_id)
    assert kept.convert_ids_to_tokens(every_id, skip_special_tokens=True) == \
        full.convert_ids_to_tokens(every_id, skip_special_tokens=True)
    assert [kept.decode([i]) for i in every_id] == [full.decode([i]) for i in every_id]
    for text in TEXTS:
        for special in (True, False):
            ids = full(text, add_special_tokens=special)["input_ids"]
            assert kept(text, add_special_tokens=special)["input_ids"] == ids, text
            assert kept.encode(text, add_special_tokens=special) == \
                full.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert kept.decode(ids, skip_special_tokens=skip) == \
                    full.decode(ids, skip_special_tokens=skip)
                assert kept.decode(ids, skip_special_tokens=skip,
                                   clean_up_tokenization_spaces=False) == \
                    full.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert kept._full is None  # all of that without transformers' tokenizer


def test_what_the_cache_does_not_answer_transformers_tokenizer_does(cache_dir):
    first, second = load_twice(DEFAULT_MODEL)
    kept = second.tokenizer
    messages = [{"role": "user", "content": "Reverse a list."},
                {"role": "assistant", "content": "def rev(x):\n    return x[::-1]"}]
    ids = kept.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert kept._full is not None  # loaded now, for this
    assert ids == first.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True)
    assert second.encode_chat(messages) == first.encode_chat(messages)
    assert kept.decode([[5, 6], [7]]) == first.tokenizer.decode([[5, 6], [7]])


def test_a_grammar_compiles_for_a_cached_tokenizer_as_for_transformers(cache_dir):
    pytest.importorskip("xgrammar")
    from genlib.sampling import grammar

    first, second = load_twice(DEFAULT_MODEL)
    ours = grammar._tokenizer(second.tokenizer, second.vocab_size, second.eos_ids)
    theirs = grammar._tokenizer(first.tokenizer, first.vocab_size, first.eos_ids)
    assert ours.digest == theirs.digest


def test_a_start_from_the_cache_imports_no_transformers(tmp_path):
    code = ("import sys\nfrom genlib.models.loading import ModelSpec, load_model\n"
            "lm = load_model(ModelSpec(sys.argv[1]), quick=True)\n"
            "ids = lm.encode('def fibonacci(n):')\n"
            "print(type(lm.tokenizer).__name__, ids, repr(lm.tokenizer.decode(ids)),\n"
            "      any(m.startswith('transformers') for m in sys.modules))\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code, str(DEFAULT_MODEL)], env=env,
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
            for _ in range(2)]
    first, second = (run.stdout.strip() for run in runs)
    assert first.startswith("TokenizersBackend [") and first.endswith(" True"), runs[0].stderr
    assert second.startswith("CachedTokenizer [") and second.endswith(" False"), runs[1].stderr
    assert first.split(" ", 1)[1].rsplit(" ", 1)[0] == second.split(" ", 1)[1].rsplit(" ", 1)[0]
    assert list((tmp_path / "genlab" / "tokenizers").glob("*.json"))


def test_a_changed_tokenizer_file_makes_the_entry_again(tmp_path, cache_dir):
    folder = tokenizer_folder(tmp_path)
    before = load(folder)
    assert isinstance(load(folder), CachedTokenizer)
    # swap two tokens' ids: the same size, and the same modification time put back
    file = folder / "tokenizer.json"
    stat = file.stat()
    text = file.read_text(encoding="utf-8")
    first, second = before.encode("def class", add_special_tokens=False)
    pieces = before.convert_ids_to_tokens([first, second])
    for piece, old, new in ((pieces[0], first, "@"), (pieces[1], second, first),
                            (pieces[0], "@", second)):
        assert text.count(f'"{piece}": {old},') == 1
        text = text.replace(f'"{piece}": {old},', f'"{piece}": {new},')
    file.write_text(text, encoding="utf-8")
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file.stat().st_size == stat.st_size
    changed = load(folder)
    assert not isinstance(changed, CachedTokenizer)
    ids = changed.encode("def class", add_special_tokens=False)
    assert ids == list(reversed(before.encode("def class", add_special_tokens=False)))
    again = load(folder)
    assert isinstance(again, CachedTokenizer)
    assert again.encode("def class", add_special_tokens=False) == ids
    assert len(list(cache_dir.glob("*.json"))) == 1  # replaced in place


@pytest.mark.parametrize("damage", ["truncated", "not json", "foreign tokenizer"])
def test_a_damaged_entry_is_made_again(tmp_path, cache_dir, damage):
    folder = tokenizer_folder(tmp_path)
    reference = load(folder)
    [entry] = cache_dir.glob("*.json")
    text = entry.read_text()
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "not json":
        entry.write_bytes(b"\0" * 100)
    else:
        state = json.loads(text)
        state["tokenizer"] = '{"version": "1.0", "model": 7}'
        entry.write_text(json.dumps(state))
    rebuilt = load(folder)
    assert not isinstance(rebuilt, CachedTokenizer)
    assert rebuilt.encode(TEXTS[4]) == reference.encode(TEXTS[4])
    assert isinstance(load(folder), CachedTokenizer)


def test_an_unwritable_cache_costs_only_the_import(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(tokenizer_cache, "directory", lambda: blocker / "tokenizers")
    folder = tokenizer_folder(tmp_path)
    first, second = load(folder), load(folder)
    assert not isinstance(second, CachedTokenizer)
    assert second.encode(TEXTS[4]) == first.encode(TEXTS[4])


def test_a_tokenizer_whose_python_layer_may_add_something_is_not_kept(tmp_path, cache_dir):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class Subclassed(TokenizersBackend):  # another class: its Python layer is unknown
        pass

    folder = tokenizer_folder(tmp_path)
    assert tokenizer_cache._state(Subclassed.from_pretrained(str(folder)), {}) is None
    plain = TokenizersBackend.from_pretrained(str(folder))
    assert tokenizer_cache._state(plain, {}) is not None
    plain.clean_up_tokenization_spaces = True  # BPE: transformers skips the clean-up
    assert tokenizer_cache._state(plain, {}) is not None


def test_the_probes_refuse_a_tokenizer_that_answers_otherwise(tmp_path, cache_dir,
                                                              monkeypatch):
    folder = tokenizer_folder(tmp_path)
    real = tokenizer_cache.CachedTokenizer._encode
    monkeypatch.setattr(tokenizer_cache.CachedTokenizer, "_encode",
                        lambda self, text, add: real(self, text, add)[:-1] or [0])
    load(folder)
    assert not list(cache_dir.glob("*.json"))


def test_cache_list_and_clear_show_and_delete_tokenizers(tmp_path, monkeypatch):
    from cli.main import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tokenizer_cache, "directory",
                        lambda: tmp_path / "xdg" / "genlab" / "tokenizers")
    folder = tokenizer_folder(tmp_path)
    load(folder)
    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.output)["entries"]
    assert (row["kind"], row["name"], row["stale"]) == ("tokenizer", str(folder.resolve()),
                                                         False)
    (folder / "tokenizer_config.json").write_text(
        (folder / "tokenizer_config.json").read_text().replace("}", ', "x": 1}', 1))
    [row] = json.loads(runner.invoke(app, ["cache", "list", "--json"]).output)["entries"]
    assert row["stale"] is True
    cleared = runner.invoke(app, ["cache", "clear", "--weights-only", "--json"])
    assert json.loads(cleared.output)["files"] == 1
    assert not list((tmp_path / "xdg" / "genlab" / "tokenizers").glob("*.json"))


def test_a_tokenizer_told_to_clean_up_bpe_spaces_is_not_kept(tmp_path, cache_dir):
    folder = tokenizer_folder(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update({"clean_up_tokenization_spaces": True,
                   "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output":
                   True})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    full = load(folder)
    ids = full.encode("you 're , . ? !", add_special_tokens=False)
    assert full.decode(ids) == "you're,.?!"  # transformers cleans up, as told
    assert not isinstance(load(folder), CachedTokenizer)
    assert not list(cache_dir.glob("*.json"))


def test_an_added_chat_template_file_makes_the_entry_again(tmp_path, cache_dir):
    folder = tokenizer_folder(tmp_path, DEFAULT_MODEL)
    load(folder)
    assert isinstance(load(folder), CachedTokenizer)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rag.jinja").write_text("{{ messages }}")
    changed = load(folder)
    assert not isinstance(changed, CachedTokenizer)
    assert isinstance(changed.chat_template, dict)  # several templates: not kept
    assert not list(cache_dir.glob("*.json"))  # nor the entry of the former files
    assert not isinstance(load(folder), CachedTokenizer)


def test_a_failure_while_keeping_a_tokenizer_leaves_transformers_one(tmp_path, cache_dir,
                                                                     monkeypatch):
    def broken(tokenizer, key):
        raise ValueError("no")

    monkeypatch.setattr(tokenizer_cache, "_state", broken)
    folder = tokenizer_folder(tmp_path)
    tokenizer = load(folder)
    assert not isinstance(tokenizer, CachedTokenizer) and tokenizer.encode("x")
    assert not list(cache_dir.glob("*.json"))


def test_what_a_cached_tokenizer_does_not_take_goes_to_transformers(tmp_path, cache_dir):
    folder = tokenizer_folder(tmp_path)
    full = load(folder)
    kept = load(folder)
    assert isinstance(kept, CachedTokenizer)
    assert kept("a b", "c d")["input_ids"] == full("a b", "c d")["input_ids"]  # a text pair
    assert kept.encode("a b", "c d") == full.encode("a b", "c d")
    ids = full.encode("def f(x):")
    assert kept.decode({"input_ids": ids}) == full.decode({"input_ids": ids})
    assert kept.decode(ids, clean_up_tokenization_spaces=True) == \
        full.decode(ids, clean_up_tokenization_spaces=True)


def test_cache_list_calls_an_entry_of_other_versions_stale(tmp_path, cache_dir):
    folder = tokenizer_folder(tmp_path)
    load(folder)
    [entry] = cache_dir.glob("*.json")
    assert tokenizer_cache.entries()[0].stale is False
    state = json.loads(entry.read_text())
    state["key"]["transformers"] = "0.0.1"
    entry.write_text(json.dumps(state))
    assert tokenizer_cache.entries()[0].stale is True
    assert not isinstance(load(folder), CachedTokenizer)  # as the next start finds it


def test_the_key_reads_no_weights(tmp_path, monkeypatch):
    folder = tokenizer_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    (folder / "rust_model.ot").write_bytes(b"\0" * 1000)
    (folder / "merges.txt").write_text("a b\n")
    read = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or real(self))
    key = tokenizer_cache._key(folder)
    assert sorted(read) == sorted(key["files"]) == \
        ["merges.txt", "tokenizer.json", "tokenizer_config.json"]
