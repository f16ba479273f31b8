"""Compiled grammars kept on disk, so that compiling a grammar once serves later runs.

An entry is named by a hash of what the compiled grammar depends on: the grammar's kind
and text, the tokenizer's content (xgrammar's TokenizerInfo, which holds the decoded
vocabulary, its type and the stop ids), xgrammar's version and this file's FORMAT. It
holds one header line (FORMAT, the sha256 of the rest, the warnings xgrammar logged while
compiling, to be given again) and xgrammar's own serialization of the grammar.

xgrammar 0.2.8 serializes every rule's automaton with a copy of the whole grammar's
automaton, so its JSON grows with rules x states: 1.5 MB for a 7-property schema, 420 MB
for an object of 1,000 optional keys, which takes 36 s to read back where compiling took
10 s. A grammar is stored only when reading it back is expected to be quicker than
compiling it was (`worth_storing` on an estimate, then `store` on the real size).

A damaged entry is ignored (and replaced by the next store); a cache folder that cannot
be written is skipped. Writes go to a temporary file renamed into place, so a reader
never sees half an entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
# xgrammar's serialization is about R * M / 10 bytes for R rules and a compiled size of
# M bytes (within 10% for the flat schemas of 200-1,000 keys measured; twice too high
# for a 7-property schema), and reads back at 9-17 MB/s (deserialize_json, on the 2-core
# machine of benchmarks/results/2026-11-27-grammar-cache.txt).
READ_BYTES_PER_S = 8e6


@dataclass(frozen=True)
class Entry:
    """A compiled grammar read back, and the warnings its compile logged."""

    compiled: Any  # xgrammar.CompiledGrammar
    warnings: tuple[str, ...]


def cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("genlab")) / "grammars"


def key(kind: str, text: str, tokenizer_digest: str) -> str:
    """The name of the entry for `text` of `kind` compiled for the tokenizer whose
    TokenizerInfo hashes to `tokenizer_digest`."""
    from importlib.metadata import version

    parts = [str(FORMAT), version("xgrammar"), kind, tokenizer_digest, text]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def tokenizer_digest(info: Any) -> str:
    """A hash of xgrammar's TokenizerInfo: everything of the tokenizer a compile reads."""
    return hashlib.sha256(info.serialize_json().encode()).hexdigest()


def _path(name: str) -> Path:
    return cache_dir() / f"{name}.grammar"


def load(name: str, info: Any) -> Entry | None:
    """The entry `name` for the tokenizer `info`; None when there is none, or when it
    cannot be read or is damaged (a later store replaces it)."""
    import xgrammar

    try:
        data = _path(name).read_bytes()
    except OSError:
        return None
    head, _, body = data.partition(b"\n")
    try:
        header = json.loads(head)
        if header.get("format") != FORMAT or header.get("sha256") != _digest(body):
            return None
        compiled = xgrammar.CompiledGrammar.deserialize_json(body.decode(), info)
        return Entry(compiled, tuple(str(w) for w in header.get("warnings", ())))
    except (ValueError, RuntimeError, AttributeError, UnicodeDecodeError):
        return None


def worth_storing(compiled: Any, compile_s: float) -> bool:
    """Whether `compiled` may be worth serializing: its estimated size would read back
    within twice its compile time (`store` checks the real size; the estimate is high
    for small grammars, twice the real size for a 7-property schema)."""
    rules = str(compiled.grammar).count("\n") + 1
    expected_bytes = rules * compiled.memory_size_bytes / 10
    return expected_bytes / READ_BYTES_PER_S < 2 * compile_s


def store(name: str, compiled: Any, warnings: Sequence[str], compile_s: float) -> None:
    """Write the entry `name` atomically, if it reads back quicker than `compile_s`;
    nothing when the cache folder cannot be made or written (read-only, full): the
    next run compiles again."""
    body = compiled.serialize_json().encode()
    if len(body) / READ_BYTES_PER_S >= compile_s:
        return
    header = json.dumps({"format": FORMAT, "sha256": _digest(body),
                         "warnings": list(warnings)}).encode()
    from genlib.cachedirs import written_whole

    with contextlib.suppress(OSError), written_whole(_path(name)) as file:
        file.write(header + b"\n" + body)


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()
