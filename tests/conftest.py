"""Shared fixtures: the real models in ../shared/models and tiny random models of
several architectures (built in memory, with the stories260K tokenizer)."""

from __future__ import annotations

import gc
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_EXTRAS = ROOT / "tests" / "without_extras"


def _without_extras() -> None:
    """GENLAB_TEST_WITHOUT=xgrammar,ray,matplotlib: the suite as on an install without
    those extras, in this process and in the CLI subprocesses the tests start
    (tests/without_extras/sitecustomize.py)."""
    if not os.environ.get("GENLAB_TEST_WITHOUT"):
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_genlab_without_extras", WITHOUT_EXTRAS / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    paths = [str(WITHOUT_EXTRAS), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


_without_extras()

import genlib  # noqa: E402, F401  (before torch: keeps triton away from a CPU torch)

SHARED_MODELS = ROOT.parent / "shared" / "models"
STORIES = SHARED_MODELS / "stories260K"
LLAMA2XS = SHARED_MODELS / "llama2xs"
CODE_TARGET = SHARED_MODELS / "code-target"
CODE_DRAFT = SHARED_MODELS / "code-draft"


# A shell starts a background job (`pytest ... &` in a script, a CI runner's step) with
# SIGINT ignored, and the commands the tests start inherit that: their Ctrl-C tests would
# then test nothing. Take SIGINT back, so children start with its default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _own_cache() -> None:
    """The suite caches the packed weights and tokenizers of hundreds of temporary models:
    it keeps them in a folder of its own (XDG_CACHE_HOME, for the CLI subprocesses too),
    removed when it ends, not in the user's cache. Only the native kernel's builds,
    seconds each and named by their source and flags, are the user's."""
    import atexit
    import shutil
    import tempfile

    from genlib import cachedirs

    builds = cachedirs.native()
    folder = Path(tempfile.mkdtemp(prefix="genlab-tests-cache-"))
    (folder / "genlab").mkdir()
    try:
        builds.mkdir(parents=True, exist_ok=True)
        (folder / "genlab" / "native").symlink_to(builds, target_is_directory=True)
    except OSError:
        pass  # the kernel is then built in the suite's folder
    os.environ["XDG_CACHE_HOME"] = str(folder)
    atexit.register(shutil.rmtree, folder, True)


_own_cache()
# A start daemon the developer runs must not serve the suite's commands: each runs in a
# process of its own, but in tests/test_daemon.py.
os.environ["GENLAB_DAEMON"] = "0"

@pytest.fixture(autouse=True)
def _thaw_the_heap():
    """The CLI freezes the heap once a model has loaded (`models.freeze_heap`), for a
    process that is its alone; in this one each test leaves the collector all of it."""
    yield
    gc.unfreeze()


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` for the block."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def ctrl_c_at(monkeypatch):
    """ctrl_c_at(n): the n-th decoding step from now on (the n-th call of a backend's
    `step` or `extend`, which every loop's steps go through) raises KeyboardInterrupt,
    as Ctrl-C arriving during that step would."""
    from genlib.backends.base import Backend

    real = {"step": Backend.step, "extend": Backend.extend}

    def arm(n: int) -> None:
        calls = 0

        def counted(name):
            def call(self, tokens):
                nonlocal calls
                calls += 1
                if calls == n:
                    raise KeyboardInterrupt
                return real[name](self, tokens)
            return call

        for name in real:
            monkeypatch.setattr(Backend, name, counted(name))

    return arm


def assert_lean_follows_transformers(model, lean, ids, tokens=(42, 7, 300, 2, 1)) -> None:
    """The lean forward's logits at prefill and after each of `tokens` against
    transformers' forward on `model`, bit for bit."""
    import torch

    hf = transformers_backend(model)
    hf_logits = hf.prefill_ids(ids, torch.ones_like(ids))[:, -1]
    cache = lean.new_cache(64)
    assert torch.equal(lean.prefill(ids, cache), hf_logits)
    for token in tokens:
        t = torch.tensor([[token]])
        assert torch.equal(lean.step(t, cache), hf.step(t[:, 0]))
    assert cache.length == hf.length == ids.shape[1] + len(tokens)


def transformers_backend(model):
    """A TransformersBackend over a bare transformers model (pad id 0: prompts here are
    not padded)."""
    from genlib.backends.transformers import TransformersBackend
    from genlib.models.info import LoadedModel

    param = next(model.parameters())
    return TransformersBackend(LoadedModel(model=model, tokenizer=None, ref="test",
                                           device=param.device, dtype=param.dtype, eos_ids=(),
                                           pad_id=0, max_positions=None))


def shared_model(path: Path):
    from genlib.models.loading import ModelSpec, load_model

    if not path.is_dir():
        pytest.skip(f"{path} is not present")
    return load_model(ModelSpec(str(path)))


@pytest.fixture(scope="session")
def stories():
    """stories260K: TinyStories Llama, 512-token sentencepiece vocab, ends stories with BOS."""
    return shared_model(STORIES)


@pytest.fixture(scope="session")
def code_target():
    return shared_model(CODE_TARGET)


@pytest.fixture(scope="session")
def llama2xs():
    return shared_model(LLAMA2XS)


def tiny_config(arch: str):
    """A small random config with peaked logits (large init), vocab 512."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, initializer_range=0.3, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256,
                          initializer_range=0.3, **common)
    if arch == "qwen2":
        return Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, initializer_range=0.3, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=256,
                             initializer_range=0.3, **common)
    raise ValueError(arch)


TINY_ARCHS = ("llama", "gpt2", "qwen2", "gpt_neox")


@pytest.fixture(scope="session")
def stories_tokenizer():
    from transformers import AutoTokenizer

    if not STORIES.is_dir():
        pytest.skip("stories260K tokenizer not present")
    return AutoTokenizer.from_pretrained(str(STORIES))


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny(request, stories_tokenizer):
    """A tiny random model of each architecture, wrapped for genlib."""
    import torch
    from transformers import AutoModelForCausalLM

    from genlib.models.loading import wrap_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(request.param))
    return wrap_model(model, stories_tokenizer, ref=f"tiny-{request.param}")


def wait_for_lines(path: Path, count: int, proc, timeout: float = 120.0) -> None:
    """Wait until `path` holds `count` lines (a run is midway), `proc` ends, or `timeout`
    seconds pass: the moment tests stop a run to see what it kept."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.01)


@pytest.fixture(scope="module")
def library():
    """The native kernel's float32 build; the test skips where it cannot be built."""
    from genlib.backends import kernel

    build = kernel.build()
    if build.library is None:
        pytest.skip(f"the native step cannot be built here: {build.reason}")
    return build.library
