"""The static-cache / compiled decode path over transformers' forward (what models the
lean forward cannot run take, and every model with GENLAB_LEAN=0) gives the same tokens as
the default path. The lean forward's own compiled step is tested in test_lean.py."""

from __future__ import annotations

import pytest
import torch

from genlib import decode, forward
from genlib.config import GenerationSettings

PROMPT = "Once upon a time"
prefill_static = forward.prefill_static


def greedy(n: int) -> GenerationSettings:
    return GenerationSettings().replace(max_new_tokens=n, ignore_eos=True)


def static_greedy(lm, ids: list[int], n: int) -> list[int]:
    """Greedy decoding over the eager (uncompiled) static-cache step via forward.extend."""
    x = torch.tensor([ids])
    logits, state = forward.prefill_static(lm.model, x, forward.static_cache_length(
        len(ids) + n, lm.max_positions), compile=False)
    out = []
    for _ in range(n):
        token = logits.argmax(-1)
        out.append(int(token))
        logits = forward.extend(state, token[:, None])[:, -1, :]
    return out


def test_static_cache_step_matches_default_greedy(stories):
    ids = stories.encode(PROMPT)
    expected = decode.generate(stories, [ids], greedy(60))[0].token_ids
    assert static_greedy(stories, ids, 60) == list(expected)


def test_static_cache_logits_equal_dynamic_cache_logits(stories):
    ids = stories.encode(PROMPT)
    x = torch.tensor([ids])
    dyn_logits, dyn = forward.prefill(stories.model, x, torch.ones_like(x))
    st_logits, st = forward.prefill_static(stories.model, x, 64, compile=False)
    torch.testing.assert_close(st_logits, dyn_logits, rtol=1e-4, atol=1e-4)
    for token in (42, 7, 300):
        t = torch.tensor([[token]])
        torch.testing.assert_close(forward.extend(st, t),
                                   forward.extend(dyn, t), rtol=1e-4, atol=1e-4)
    assert st.length == dyn.length == len(ids) + 3


def test_static_cache_length_rounds_up_within_positions():
    assert forward.static_cache_length(130, 512) == 256
    assert forward.static_cache_length(300, 512) == 512
    assert forward.static_cache_length(300, 400) == 400
    assert forward.static_cache_length(1, None) == 256


def test_compile_with_a_batch_falls_back_to_the_dynamic_cache(stories):
    """Two rows cannot use the static path; compile=True must still give the same rows."""
    prompts = [stories.encode(PROMPT), stories.encode("The cat")]
    plain = decode.generate(stories, prompts, greedy(20))
    events = list(decode.stream(stories, prompts, greedy(20), compile=True))
    compiled = sorted((e for e in events if type(e).__name__ == "Finish"), key=lambda f: f.row)
    assert [f.token_ids for f in compiled] == [f.token_ids for f in plain]


def test_logits_to_keep_probe_is_cached(stories):
    forward.accepts_logits_to_keep(stories.model)
    before = forward._forward_takes_logits_to_keep.cache_info().hits
    forward.accepts_logits_to_keep(stories.model)
    assert forward._forward_takes_logits_to_keep.cache_info().hits == before + 1


@pytest.mark.slow
def test_compiled_path_is_token_identical_to_default(stories, monkeypatch):
    """torch.compile over transformers' static-cache step (compiles once: tens of seconds
    on 2 cores); GENLAB_LEAN=0, or stories260K would take the lean forward's step."""
    monkeypatch.setenv("GENLAB_LEAN", "0")
    calls = []
    monkeypatch.setattr(forward, "prefill_static",
                        lambda *a, **k: calls.append(1) or prefill_static(*a, **k))
    ids = stories.encode(PROMPT)
    expected = decode.generate(stories, [ids], greedy(80))[0]
    events = list(decode.stream(stories, [ids], greedy(80), compile=True))
    got = events[-1]
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.text.startswith(", there was a little girl named Lily.")
    assert calls == [1]  # the compiled generation went through the static-cache step
