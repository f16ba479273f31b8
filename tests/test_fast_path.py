"""The compiled backend over transformers' forward with a static cache (what models the
lean forward cannot run take under --backend compiled, and every model with
GENLAB_LEAN=0) gives the same tokens as the default path. The lean forward's own compiled
step is tested in test_lean.py."""

from __future__ import annotations

import pytest
import torch

from genlib import generate
from genlib.backends import compiled, transformers
from genlib.backends.choose import Request, choose_backend
from genlib.backends.compiled import CompiledStaticBackend
from genlib.backends.lean import cache_capacity
from genlib.backends.transformers import TransformersBackend
from genlib.errors import ConfigError
from genlib.settings.config import GenerationSettings

PROMPT = "Once upon a time"


def greedy(n: int) -> GenerationSettings:
    return GenerationSettings().replace(max_new_tokens=n, ignore_eos=True)


@pytest.fixture
def eager_static(monkeypatch):
    """CompiledStaticBackend's single-token step left uncompiled (the static-cache step
    itself, eagerly)."""
    monkeypatch.setattr(compiled, "compiled_step", lambda model: compiled._one_token_step)


def static_greedy(lm, ids: list[int], n: int) -> list[int]:
    """Greedy decoding over the static-cache backend's step."""
    backend = CompiledStaticBackend(lm)
    logits = backend.prefill([ids], len(ids) + n)
    out = []
    for _ in range(n):
        token = logits.argmax(-1)
        out.append(int(token))
        logits = backend.step(token)
    return out


def test_static_cache_step_matches_default_greedy(stories, eager_static):
    ids = stories.encode(PROMPT)
    expected = generate.generate(stories, [ids], greedy(60))[0].token_ids
    assert static_greedy(stories, ids, 60) == list(expected)


def test_static_cache_logits_equal_dynamic_cache_logits(stories, eager_static):
    ids = stories.encode(PROMPT)
    x = torch.tensor([ids])
    dyn = TransformersBackend(stories)
    dyn_logits = dyn.prefill_ids(x, torch.ones_like(x))[:, -1]
    st = CompiledStaticBackend(stories)
    st_logits = st.prefill([ids], 64)
    torch.testing.assert_close(st_logits, dyn_logits, rtol=1e-4, atol=1e-4)
    for token in (42, 7, 300):
        t = torch.tensor([[token]])
        torch.testing.assert_close(st.extend(t), dyn.extend(t), rtol=1e-4, atol=1e-4)
    assert st.length == dyn.length == len(ids) + 3


def test_static_cache_length_rounds_up_within_positions():
    assert cache_capacity(130, 512) == 256
    assert cache_capacity(300, 512) == 512
    assert cache_capacity(300, 400) == 400
    assert cache_capacity(1, None) == 256


def test_compiled_with_a_batch_is_refused_and_auto_takes_another(stories, monkeypatch):
    """Two rows cannot use the static path: --backend compiled is refused, naming what
    would work, and auto runs the batch on a backend that holds rows (transformers'
    forward without the native kernel), row for row as each prompt alone."""
    monkeypatch.setenv("GENLAB_NATIVE", "0")
    prompts = [stories.encode(PROMPT), stories.encode("The cat")]
    with pytest.raises(ConfigError, match="the compiled backend runs one row.*--backend "
                                          "native or transformers"):
        generate.generate(stories, prompts, greedy(20), backend="compiled")
    events = list(generate.stream(stories, prompts, greedy(20)))
    assert (events[0].backend, events[0].backend_reason) == \
        ("transformers", "transformers' forward; GENLAB_NATIVE=0 keeps auto off the native "
                         "kernel")
    batch = sorted((e for e in events if type(e).__name__ == "Finish"), key=lambda f: f.row)
    assert [f.token_ids for f in batch] \
        == [generate.generate(stories, [p], greedy(20))[0].token_ids for p in prompts]


def test_compiled_static_cache_cannot_roll_back(stories, monkeypatch):
    monkeypatch.setenv("GENLAB_LEAN", "0")
    backend = choose_backend(stories, Request(backend="compiled"))
    assert type(backend) is CompiledStaticBackend
    with pytest.raises(ConfigError, match="cannot roll it back"):
        choose_backend(stories, Request(backend="compiled", crop=True))
    with pytest.raises(ConfigError, match="cannot roll its cache back"):
        backend.crop(0)


def test_logits_to_keep_probe_is_cached(stories):
    transformers.accepts_logits_to_keep(stories.model)
    before = transformers._forward_takes_logits_to_keep.cache_info().hits
    transformers.accepts_logits_to_keep(stories.model)
    assert transformers._forward_takes_logits_to_keep.cache_info().hits == before + 1


@pytest.mark.slow
def test_compiled_path_is_token_identical_to_default(stories, monkeypatch):
    """torch.compile over transformers' static-cache step (compiles once: tens of seconds
    on 2 cores); GENLAB_LEAN=0, or stories260K would take the lean forward's step."""
    monkeypatch.setenv("GENLAB_LEAN", "0")
    prefills, steps = [], []
    real_prefill, real_step = CompiledStaticBackend._prefill, compiled.compiled_step
    monkeypatch.setattr(CompiledStaticBackend, "_prefill",
                        lambda *a: prefills.append(1) or real_prefill(*a))
    monkeypatch.setattr(compiled, "compiled_step",
                        lambda model: steps.append(1) or real_step(model))
    ids = stories.encode(PROMPT)
    expected = generate.generate(stories, [ids], greedy(80))[0]
    events = list(generate.stream(stories, [ids], greedy(80), backend="compiled"))
    assert events[0].backend == "compiled"
    got = events[-1]
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.text.startswith(", there was a little girl named Lily.")
    assert prefills == [1]  # the compiled generation went through the static-cache step
    assert len(steps) == 79  # every step after the prefill's token
