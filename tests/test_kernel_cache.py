"""The native kernel's build cache heals itself (a library that will not load is built
again once; a file or folder in the way is cleared), and $CC is split as a shell would,
its whole command in the cache key. Each test builds into its own cache folder."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from genlib.backends import kernel
from genlib.backends.llama import LeanLlama
from tests.conftest import ROOT, STORIES
from tests.test_native import assert_native_follows_lean, tiny

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


@pytest.fixture
def cache(monkeypatch, tmp_path: Path) -> Path:
    """An empty cache folder of this test's own, and a fresh `build` before and after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    kernel.build.cache_clear()
    yield tmp_path / "genlab" / "native"
    kernel.build.cache_clear()


def counted_compiles(monkeypatch) -> list[Path]:
    """The libraries `_compile` builds from now on (it still builds them)."""
    built: list[Path] = []
    real = kernel._compile

    def counting(compiler, flags, source, library):
        built.append(library)
        real(compiler, flags, source, library)

    monkeypatch.setattr(kernel, "_compile", counting)
    return built


def runs_like_lean(library) -> None:
    lean = LeanLlama.from_model(tiny("llama"))
    assert_native_follows_lean(lean, kernel.NativeStep(lean, 1, library), [1, 5, 9, 200])


def built_once(cache: Path) -> Path:
    """The cached library, compiled and not loaded: once a process has loaded a path,
    dlopen hands back that library for the path whatever the file holds since."""
    compiler = kernel._compiler()
    library = kernel._library_path(compiler, kernel.FLAGS, kernel.SOURCE)
    kernel._compile(compiler, kernel.FLAGS, kernel.SOURCE, library)
    assert list(cache.glob("lean_step-*.so")) == [library]
    return library


def test_a_cached_library_that_will_not_load_is_rebuilt_once_and_runs(cache, monkeypatch):
    library = built_once(cache)
    library.unlink()  # a new file, not the bytes this process has mapped
    library.write_bytes(b"\x7fELF damaged" + bytes(4000))
    kernel._digest_file(library).write_text(hashlib.sha256(library.read_bytes()).hexdigest())
    compiles = counted_compiles(monkeypatch)
    build = kernel.build()
    assert compiles == [library]
    assert build.library is not None, build.reason
    assert build.notice.startswith("the cached native kernel would not load (")
    assert "rebuilt it" in build.notice
    runs_like_lean(build.library)
    kernel.build.cache_clear()
    assert kernel.build().notice == "" and compiles == [library]  # healed: loads as it is


def test_a_library_that_will_not_load_or_rebuild_says_both(cache, monkeypatch):
    library = built_once(cache)
    library.unlink()
    library.write_bytes(b"not a library")
    kernel._digest_file(library).write_text(hashlib.sha256(b"not a library").hexdigest())

    def failing(*_: object) -> None:
        raise OSError("cc failed: no space left")

    monkeypatch.setattr(kernel, "_compile", failing)
    build = kernel.build()
    assert build.library is None
    assert build.reason == build.notice
    assert build.reason.startswith(f"could not load or rebuild the cached native kernel "
                                   f"{library}: cc failed: no space left")


@pytest.mark.parametrize("obstacle", ["library-is-a-folder", "cache-is-a-file"])
def test_a_file_or_folder_in_the_caches_way_is_cleared(cache, monkeypatch, obstacle: str):
    if obstacle == "library-is-a-folder":
        library = built_once(cache)
        for path in cache.iterdir():
            path.unlink()
        (library / "inside").mkdir(parents=True)
    else:
        cache.parent.mkdir(parents=True)
        cache.write_text("not a folder")
    compiles = counted_compiles(monkeypatch)
    build = kernel.build()
    assert build.library is not None, build.reason
    assert len(compiles) == 1
    assert cache.is_dir() and [p.is_file() for p in cache.glob("lean_step-*.so")] == [True]
    runs_like_lean(build.library)


def test_cc_with_arguments_builds_with_them_under_its_own_key(cache, monkeypatch):
    plain = built_once(cache)
    monkeypatch.setenv("CC", "cc -O2")
    compiles = counted_compiles(monkeypatch)
    build = kernel.build()
    assert build.library is not None, build.reason
    assert len(compiles) == 1 and compiles[0] != plain  # the arguments are in the key
    runs_like_lean(build.library)


def test_cc_that_names_no_program_says_so_on_stderr(tmp_path: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "CC": "nonexistent-cc -O2",
           "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "cli", "generate", "Once upon a time", "-m",
                           str(STORIES), "-n", "4"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # the lean backend still generates
    assert ("warning: could not build lean_step.c: CC='nonexistent-cc -O2' names no program "
            "('nonexistent-cc' is not found), so the native kernel is off; set CC to a C "
            "compiler, or unset it to use cc") in done.stderr
    assert done.stderr.count("names no program") == 1


def test_unbalanced_quotes_in_cc_are_one_word_that_names_no_program(cache, monkeypatch):
    monkeypatch.setenv("CC", "cc 'unclosed")
    build = kernel.build()
    assert build.library is None
    assert build.notice.startswith("could not build lean_step.c: CC=\"cc 'unclosed\" names "
                                   "no program")
