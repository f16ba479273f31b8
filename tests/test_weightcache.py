"""genlib.backends.weightcache and the native kernel's packed weights through it: written
once and mapped after, rebuilt when damaged or stale, whole after two builders race, in
memory with one line when the directory cannot be written; the tokens of mapped weights
are those of a fresh pack, and the native path keeps no float copy of the matrices."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from genlib.backends import kernel, weightcache
from genlib.backends.native import native_step
from genlib.models.loading import ModelSpec, load_model
from tests.conftest import CODE_TARGET, ROOT, STORIES

KEY = {"file": "/models/m/model.safetensors", "size": 1, "mtime_ns": 2, "weights": "float32"}


def sample_tensors() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes, sizes that are not multiples of the alignment,
    and more than a sample's bytes (so a damage between the samples is in the data)."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 1000, 7, generator=g),
            "b": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "codes": torch.randint(0, 256, (12345,), dtype=torch.uint8, generator=g),
            "empty": torch.zeros(0)}


class Builds:
    """A build function that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        self.calls += 1
        return sample_tensors()


@pytest.fixture
def cache_home(monkeypatch, tmp_path) -> Path:
    """An empty weight cache (the kernel's builds, memoised per process, stay as they are)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "genlab" / "weights"


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_the_cache_is_written_once_then_mapped_without_building(cache_home):
    build = Builds()
    first = weightcache.cached("m-float32", KEY, build)
    again = weightcache.cached("m-float32", KEY, build)
    assert build.calls == 1
    assert same(first, sample_tensors()) and same(again, sample_tensors())
    assert [p.name for p in cache_home.iterdir()] == ["m-float32.weights"]
    # mapped from the file: every tensor on the kernel's alignment, in the file's pages
    whole = next(iter(again.values())).untyped_storage()
    assert whole.nbytes() == (cache_home / "m-float32.weights").stat().st_size
    assert all(t.data_ptr() % weightcache.ALIGN == 0 for t in again.values())


@pytest.mark.parametrize("damage", ["truncated", "bytes overwritten", "not a cache file"])
def test_a_damaged_entry_is_rebuilt(cache_home, damage):
    build = Builds()
    weightcache.cached("m", KEY, build)
    path = cache_home / "m.weights"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:-100]
    elif damage == "bytes overwritten":
        offset = weightcache._header(path)["tensors"]["a"]["offset"]
        data[offset + 8:offset + 16] = bytes(8)
    else:
        data = bytearray(b"\0" * len(data))
    path.write_bytes(bytes(data))
    assert same(weightcache.cached("m", KEY, build), sample_tensors())
    assert build.calls == 2
    assert weightcache.cached("m", KEY, build) and build.calls == 2  # rewritten whole


def test_a_stale_entry_is_rebuilt_in_place(cache_home):
    build = Builds()
    weightcache.cached("m", KEY, build)
    newer = {**KEY, "mtime_ns": KEY["mtime_ns"] + 1}  # the model file was rewritten
    weightcache.cached("m", newer, build)
    assert build.calls == 2
    weightcache.cached("m", newer, build)
    assert build.calls == 2 and len(list(cache_home.iterdir())) == 1


def test_a_cache_that_cannot_be_written_packs_in_memory_with_one_line(cache_home):
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("a file where the directory would be")  # root ignores modes
    said: list[str] = []
    build = Builds()
    assert same(weightcache.cached("m", KEY, build, said.append), sample_tensors())
    assert len(said) == 1 and "cannot be written" in said[0] and str(cache_home) in said[0]
    assert "packed again on the next start" in said[0]


RACER = textwrap.dedent("""
    import sys, time, torch
    from genlib.backends import weightcache
    def build():
        time.sleep(1.0)  # both processes miss, then both write
        racer = int(sys.argv[1])  # each its own bytes: a file mixing the two is not whole
        g = torch.Generator().manual_seed(racer)
        return {"w": torch.randn(1 << 21, generator=g), "racer": torch.tensor([racer])}
    weightcache.cached("race", {"k": 1}, build)
""")


def test_two_processes_building_at_once_leave_the_entry_whole(cache_home):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home.parents[1])}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(racer)], cwd=ROOT, env=env)
              for racer in (1, 2)]
    assert [r.wait(timeout=120) for r in racers] == [0, 0]
    assert [p.name for p in cache_home.iterdir()] == ["race.weights"]  # no temporary left

    def fail() -> dict[str, torch.Tensor]:
        raise AssertionError("the raced entry was not whole")

    got = weightcache.cached("race", {"k": 1}, fail)
    racer = int(got["racer"])
    assert racer in (1, 2)
    assert torch.equal(got["w"], torch.randn(1 << 21,
                                             generator=torch.Generator().manual_seed(racer)))


# --- The native kernel's packed weights ----------------------------------------------

def quick_code_target():
    if not CODE_TARGET.is_dir():
        pytest.skip(f"{CODE_TARGET} is not present")
    lm = load_model(ModelSpec(str(CODE_TARGET)), quick=True)
    assert lm.lean is not None and lm.lean.weights_file is not None
    return lm


def greedy_tokens(lm, step, n: int = 24) -> list[int]:
    cache = lm.lean.new_cache(64)
    ids = lm.encode("import os\nimport sys\n\n\ndef main(")
    logits = step.extend(ids, cache, all_logits=False)
    out = []
    for _ in range(n):
        token = int(logits[0].argmax())
        out.append(token)
        logits = step(token, cache)
        cache.length += 1
    return out


def test_mapped_weights_give_the_tokens_of_a_fresh_pack_and_are_not_packed_again(
        cache_home, monkeypatch):
    fresh = quick_code_target()
    packed = kernel.NativeStep(fresh.lean, 2)
    assert len(list(cache_home.glob("*.weights"))) == 1
    reference = kernel.NativeStep(_lean_of_transformers(), 2)  # no file: packed in memory

    def no_packing(*args, **kwargs):
        raise AssertionError("packed again instead of mapped from the cache")

    monkeypatch.setattr(kernel, "pack_weights", no_packing)
    mapped_lm = quick_code_target()
    mapped = kernel.NativeStep(mapped_lm.lean, 2)
    want = greedy_tokens(fresh, reference)
    assert greedy_tokens(fresh, packed) == want
    assert greedy_tokens(mapped_lm, mapped) == want
    assert len(set(want)) > 8  # varied tokens: the weights did their work


def test_a_pack_by_another_quantizer_is_packed_again(cache_home, monkeypatch):
    """The key holds quant.ENCODERS' version: nf4 codes chosen another way are not
    mapped."""
    from genlib.backends import quant

    calls = []
    pack_weights = kernel.pack_weights
    monkeypatch.setattr(kernel, "pack_weights", lambda *a, **k: calls.append(1) or
                        pack_weights(*a, **k))
    kernel.NativeStep(quick_code_target().lean, 2, weights="nf4")
    kernel.NativeStep(quick_code_target().lean, 2, weights="nf4")
    assert len(calls) == 1
    monkeypatch.setitem(quant.ENCODERS, "nf4", quant.ENCODERS["nf4"] + 1)
    kernel.NativeStep(quick_code_target().lean, 2, weights="nf4")
    assert len(calls) == 2 and len(list(cache_home.glob("*.weights"))) == 1


def _lean_of_transformers():
    from genlib.backends.lean import lean_model_of

    return lean_model_of(load_model(ModelSpec(str(CODE_TARGET))))


def test_the_native_path_keeps_no_float_copy_of_the_matrices(cache_home):
    lm = quick_code_target()
    native_step(lm.lean)
    step = kernel.NativeStep(lm.lean, 2)  # a second step: mapped from the cache
    # the torch forward's fused matrices and output projection were never made
    assert "layers" not in vars(lm.lean) and "lm_head" not in vars(lm.lean)
    matrices = {name for name in lm.lean.tensors if name.endswith("proj.weight")}
    floats = {lm.lean.tensors[name].untyped_storage().data_ptr() for name in matrices}
    assert not floats & {t.untyped_storage().data_ptr() for t in step._kept
                         if isinstance(t, torch.Tensor)}
    # ... and the lean forward still runs, its layers made on first use
    cache = lm.lean.new_cache(16)
    assert lm.lean.prefill(torch.tensor([[1, 2, 3]]), cache).shape == (1, lm.lean.vocab)


PEAK = textwrap.dedent("""
    import resource, sys
    from genlib.backends.native import native_step
    from genlib.models.loading import ModelSpec, load_model
    def start(path):
        lm = load_model(ModelSpec(path), quick=True)
        step = native_step(lm.lean)
        cache = lm.lean.new_cache(64)
        step.extend(list(range(1, 33)), cache)
        step(5, cache)
        return lm
    start(sys.argv[2])  # every import and the kernel's build first, on a tiny model
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lm = start(sys.argv[1])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    weights = sum(t.numel() * t.element_size() for t in lm.lean.tensors.values())
    print(grown * 1024 / weights)
""")


@pytest.mark.parametrize("start", ["packs", "maps"])
def test_peak_memory_of_a_native_start_is_about_one_copy_of_the_weights(tmp_path, start):
    """Peak RSS grown by loading code-target and running the kernel, in weights' bytes:
    about 1 (one packed copy; the embeddings' rows and norms read in place), where the
    float matrices beside the packed ones made it 2.5-3."""
    if not CODE_TARGET.is_dir() or not STORIES.is_dir():
        pytest.skip("the shared models are not present")
    native = kernel._cache_dir()  # the kernel's builds, not built again
    (tmp_path / "genlab").mkdir()
    if native.is_dir():
        (tmp_path / "genlab" / "native").symlink_to(native)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2 if start == "maps" else 1):
        done = subprocess.run([sys.executable, "-c", PEAK, str(CODE_TARGET), str(STORIES)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.5


# --- genlab cache list / clear, and the CLI's one line -------------------------------

def genlab(*args: str, home: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(home), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cache_list_and_clear_show_and_free_entries_and_builds(cache_home, tmp_path):
    home = cache_home.parents[1]
    empty = genlab("cache", "list", home=home)
    assert (empty.returncode, empty.stdout.strip()) == (0, f"the cache is empty ({home}/genlab)")
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"weights")
    stat = model.stat()
    key = {"file": str(model), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "weights": "bfloat16"}
    weightcache.cached("m-bfloat16", key, sample_tensors)
    entry_size = (cache_home / "m-bfloat16.weights").stat().st_size
    (home / "genlab" / "native").mkdir()
    (home / "genlab" / "native" / "lean_step-abc.so").write_bytes(bytes(40_000))
    (home / "genlab" / "native" / "lean_step-abc.so.sha256").write_bytes(bytes(64))
    listed = genlab("cache", "list", home=home)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("│") for line in listed.stdout.splitlines() if "│" in line]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["weights", str(model), "bfloat16", weightcache_size(entry_size), "current"],
        ["kernel", "lean_step-abc.so", "", "40.1 kB", ""]]
    assert listed.stdout.strip().endswith(
        f"total {weightcache_size(entry_size + 40_064)} in {home}/genlab")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the model rewritten
    stale = genlab("cache", "list", home=home).stdout
    assert [cell.strip() for cell in stale.splitlines()[2].split("│")][-1] == "stale"
    assert " ".join(stale.split()).endswith(
        "stale: its model's files changed since it was made; the next load makes it again "
        "(`genlab cache clear` frees it now)")
    kept = genlab("cache", "clear", "--weights-only", home=home)
    assert (kept.returncode, kept.stdout.strip()) == (
        0, f"freed {weightcache_size(entry_size)} (1 file) from {home}/genlab")
    assert not list(cache_home.iterdir())
    assert (home / "genlab" / "native" / "lean_step-abc.so").exists()
    cleared = genlab("cache", "clear", home=home)
    assert (cleared.returncode, cleared.stdout.strip()) == (
        0, f"freed 40.1 kB (2 files) from {home}/genlab")
    assert genlab("cache", "list", home=home).stdout.startswith("the cache is empty")


def weightcache_size(size: int) -> str:
    from cli.cache import size_text

    return size_text(size)


def test_size_text_reads_as_people_write_sizes():
    from cli.cache import size_text

    assert [size_text(n) for n in (40, 1_000, 81_920, 69_214_208, 1_321_487_968,
                                   123_456_789_012)] == [
        "40 B", "1 kB", "81.9 kB", "69.2 MB", "1.32 GB", "123 GB"]


def test_generate_with_a_cache_that_cannot_be_written_says_so_once(tmp_path):
    if not STORIES.is_dir():
        pytest.skip(f"{STORIES} is not present")
    (tmp_path / "genlab").mkdir()
    native = kernel._cache_dir()
    if native.is_dir():
        (tmp_path / "genlab" / "native").symlink_to(native)  # the kernel, not built again
    args = ("generate", "-m", str(STORIES), "-n", "12", "--seed", "3", "Once upon a time")
    writable = genlab(*args, home=tmp_path)
    assert writable.returncode == 0 and "weight cache" not in writable.stderr
    for entry in (tmp_path / "genlab" / "weights").iterdir():
        entry.unlink()
    (tmp_path / "genlab" / "weights").rmdir()
    (tmp_path / "genlab" / "weights").write_text("not a folder")
    done = genlab(*args, home=tmp_path)
    assert done.returncode == 0 and done.stdout == writable.stdout
    said = [line for line in done.stderr.splitlines() if "weight cache" in line]
    assert said == [f"warning: the weight cache {tmp_path}/genlab/weights cannot be written "
                    "(File exists); the weights stay packed in memory only, and are packed "
                    "again on the next start"]


@pytest.mark.parametrize("command", ["list", "clear"])
def test_a_cache_folder_the_user_may_not_read_is_one_line(tmp_path, command):
    """It said "unexpected PermissionError", exit 1."""
    import shutil

    native = tmp_path / "genlab" / "native"
    native.mkdir(parents=True)
    native.chmod(0)
    run = [sys.executable, "-m", "cli", "cache", command]
    if os.geteuid() == 0:  # root reads anything: drop that power for the run
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        run = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *run]
    try:
        done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    finally:
        native.chmod(0o755)
    assert (done.returncode, done.stderr.strip()) == (1, (
        f"error: cannot read {native} (permission denied); give yourself access (chmod -R "
        f"u+rwX {tmp_path / 'genlab'})"))
