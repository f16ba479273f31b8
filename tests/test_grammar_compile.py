"""Compiling a grammar: Ctrl-C and SIGTERM stop a long compile at once, --grammar-timeout
bounds it, and compiled grammars are cached on disk (per grammar text, tokenizer content
and xgrammar version), where a damaged entry is replaced and an unwritable folder skipped."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("xgrammar", reason="the grammar extra: pip install 'genlab[grammar]'")

from genlib.errors import GenlabWarning
from genlib.models.loading import DEFAULT_MODEL, ModelSpec, load_model
from genlib.sampling import grammar, grammar_cache
from genlib.settings.config import resolve_settings

ROOT = Path(__file__).resolve().parent.parent
CODE_TARGET = ROOT.parent / "shared" / "models" / "code-target"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"]}


def slow_schema(path: Path, keys: int = 2000) -> Path:
    """An object of `keys` optional string properties: xgrammar 0.2.8 takes about 10 s
    for 1,000 of them on a 2-core machine, and four times that for twice as many."""
    schema = {"type": "object", "properties": {f"key_{i}": {"type": "string"}
                                               for i in range(keys)}}
    path.write_text(json.dumps(schema))
    return path


def start_compile(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    """`generate` with the slow schema on code-target, in a cache folder of its own
    (the lean forward: no native kernel to build there)."""
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache"), "GENLAB_NATIVE": "0",
                        "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "generate", "x = ", "-m", str(CODE_TARGET), "-n", "3",
         "--json-schema", str(slow_schema(tmp_path / "big.json")), *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_compiling(child: subprocess.Popen[str]) -> str:
    """stderr up to the line that says the schema is compiling (a compile of over half a
    second announces itself)."""
    assert child.stderr is not None
    seen = ""
    for line in child.stderr:
        seen += line
        if line.startswith("compiling JSON schema grammar"):
            return seen
    raise AssertionError(f"no 'compiling' line; stderr: {seen!r}")


@pytest.mark.skipif(not CODE_TARGET.is_dir(), reason="needs ../shared/models/code-target")
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_a_long_schema_compile_within_2_s(tmp_path, signum, code):
    child = start_compile(tmp_path, "--grammar-timeout", "600")
    try:
        seen = wait_for_compiling(child)
        time.sleep(1)  # well inside the C++ compile, not on the way in
        assert re.search(r"^compiling JSON schema grammar \([\d,]+ bytes\) for code-target\.\.\.$",
                         seen, re.M)
        child.send_signal(signum)
        sent = time.monotonic()
        stdout, stderr = child.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        child.kill()
    assert (child.returncode, stderr, stdout) == (code, "error: interrupted\n", "")
    assert took < 2, f"exited {took:.1f} s after the signal"


@pytest.mark.skipif(not CODE_TARGET.is_dir(), reason="needs ../shared/models/code-target")
def test_a_compile_past_grammar_timeout_stops_with_one_line_and_exit_1(tmp_path):
    child = start_compile(tmp_path, "--grammar-timeout", "1")
    try:
        stdout, stderr = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 1, stderr
    assert stderr.splitlines()[-1] == (
        "error: the json_schema grammar took longer than 1 s to compile; raise "
        "--grammar-timeout (grammar_timeout in a preset), or make the JSON schema smaller")
    assert "Traceback" not in stderr and stdout == ""


@pytest.fixture(scope="module")
def builtin():
    return load_model(ModelSpec(str(DEFAULT_MODEL)))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, empty memory caches, and every compile stored
    (the rule for when storing pays has tests of its own)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(grammar, "_COMPILED", type(grammar._COMPILED)())
    monkeypatch.setattr(grammar_cache, "READ_BYTES_PER_S", float("inf"))
    return tmp_path / "genlab" / "grammars"


def compile_schema(lm, schema=SCHEMA):
    settings = resolve_settings({"json_schema": schema})
    return grammar.compile_for(lm.tokenizer, lm.vocab_size, lm.eos_ids, settings)


def no_compiler(monkeypatch):
    """Make any compile fail the test: what follows must come from the cache."""
    class Refused:
        def __init__(self, *args, **kwargs):
            raise AssertionError("compiled, where the cache should have served")

    monkeypatch.setattr(grammar._xgrammar(), "GrammarCompiler", Refused)


def test_a_second_run_reads_the_grammar_from_the_disk_cache(builtin, cache, monkeypatch):
    first = compile_schema(builtin)
    entries = list(cache.glob("*.grammar"))
    assert len(entries) == 1
    grammar._COMPILED.clear()  # a new process: only the disk remembers
    no_compiler(monkeypatch)
    second = compile_schema(builtin)
    assert second.grammar.serialize_json() == first.grammar.serialize_json()
    assert second.valid is not None and second.valid(builtin.encode('{"name": "ab", "n": 1}'))


def test_the_cache_keys_on_the_grammar_text(builtin, cache, monkeypatch):
    compile_schema(builtin)
    grammar._COMPILED.clear()
    no_compiler(monkeypatch)
    with pytest.raises(AssertionError, match="compiled, where the cache"):
        compile_schema(builtin, SCHEMA | {"required": ["name"]})


def test_a_damaged_entry_is_compiled_again_and_replaced(builtin, cache):
    compile_schema(builtin)
    (entry,) = cache.glob("*.grammar")
    good = entry.read_bytes()
    entry.write_bytes(good[: len(good) // 2])  # a write cut short
    grammar._COMPILED.clear()
    compile_schema(builtin)
    assert entry.read_bytes() == good


def test_a_cache_folder_that_cannot_be_made_is_skipped(builtin, cache, tmp_path):
    (tmp_path / "genlab").write_text("a file where the folder would go")
    assert compile_schema(builtin) is not None
    assert not cache.exists()


def test_xgrammars_warnings_are_given_again_from_the_cache(builtin, cache, monkeypatch):
    schema = {"type": "string", "pattern": "a$b"}
    with pytest.warns(GenlabWarning) as compiled:
        compile_schema(builtin, schema)
    grammar._COMPILED.clear()
    no_compiler(monkeypatch)
    with pytest.warns(GenlabWarning) as cached:
        compile_schema(builtin, schema)
    assert [str(w.message) for w in cached] == [str(w.message) for w in compiled]
    assert "Anchor '$' in the middle of regex is ignored" in str(cached[0].message)


def test_a_grammar_is_stored_only_where_reading_it_back_pays():
    """xgrammar 0.2.8's JSON grows with rules x compiled size: 1,000 optional keys
    (1,001 rules, 3.8 MB compiled) made 420 MB that read back in 36 s, after a 10 s
    compile; a 7-property schema (78 rules, 0.37 MB) 1.5 MB in 0.15 s after 0.31 s."""
    flat = SimpleNamespace(grammar="rule\n" * 1000, memory_size_bytes=3_829_896)
    small = SimpleNamespace(grammar="rule\n" * 77, memory_size_bytes=369_840)
    assert not grammar_cache.worth_storing(flat, 10.05)
    assert grammar_cache.worth_storing(small, 0.31)
    assert not grammar_cache.worth_storing(small, 0.05)


def test_a_grammar_whose_real_size_reads_back_slower_than_it_compiled_is_not_stored(cache):
    big = SimpleNamespace(serialize_json=lambda: "x" * 8_000_000)  # 1 s to read back
    grammar_cache.READ_BYTES_PER_S = 8e6  # restored by the fixture's monkeypatch
    grammar_cache.store("a", big, [], compile_s=0.5)
    assert not cache.exists()
    grammar_cache.store("a", big, [], compile_s=2.0)
    assert (cache / "a.grammar").stat().st_size > 8_000_000


def test_tokenizer_views_are_kept_per_object_not_per_id(builtin):
    """A freed tokenizer's view goes with it: a new object given its id() must not
    find it."""
    import copy

    other = copy.deepcopy(builtin.tokenizer)
    view = grammar._tokenizer(other, builtin.vocab_size, builtin.eos_ids)
    assert grammar._TOKENIZERS[other][(builtin.vocab_size, tuple(builtin.eos_ids))] is view
    del other
    gc.collect()
    assert not any(view in views.values() for views in grammar._TOKENIZERS.values())
