"""Speculative decoding (genlib.decoding.speculative, genlib.decoding.drafters, `genlab speculate`).

Greedy speculation must equal the target's own greedy decoding token for token; speculative
sampling must follow the processed target distribution (checked against the exact
distribution with a chi-square test); rolled-back caches must match a fresh prefill.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from genlib.backends import kernel
from genlib.backends.base import Bans
from genlib.backends.choose import Request, choose_backend
from genlib.backends.lean import LeanBackend, lean_model_of
from genlib.backends.native import NativeBackend
from genlib.decoding.drafters import (
    LookupFirstDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    lookup,
    prefill_all_but_last,
)
from genlib.decoding.speculative import (
    GammaSchedule,
    Summary,
    make_drafter,
    predicted_speedup,
    process,
    process_block,
    speculative_step,
    speculative_stream,
    start,
    summarize,
)
from genlib.decoding.step import draft_bans, make_plan
from genlib.errors import ConfigError, ContextLengthError, ModelLoadError
from genlib.events import Finish, Prefill, Token, Verify
from genlib.generate import generate
from genlib.models.loading import LoadedModel, ModelSpec, load_model
from genlib.settings.config import resolve_settings
from tests.conftest import torch_threads, transformers_backend

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
needs_models = pytest.mark.skipif(not (MODELS / "stories260K").is_dir(),
                                  reason="../shared/models not present")


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def stories() -> LoadedModel:
    return load_model(ModelSpec(str(MODELS / "stories260K"), device="cpu"))


@pytest.fixture(scope="module")
def xs() -> LoadedModel:
    return load_model(ModelSpec(str(MODELS / "llama2xs"), device="cpu"))


class CharTokenizer:
    """Token i is the letter chr(97 + i): enough for the detokenizer and vocab check."""

    def __init__(self, size: int):
        self.size = size

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(97 + i) for i in ids)

    def get_vocab(self) -> dict[str, int]:
        return {chr(97 + i): i for i in range(self.size)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: on a shared 2-core machine a second torch thread only
    spins waiting (25x slower under load)."""
    with torch_threads(1):
        yield


def tiny_lm(seed: int, vocab: int = 6, like: LoadedModel | None = None) -> LoadedModel:
    """A random one-layer Llama with peaked next-token distributions; with `like`, a
    noisy copy of that model (a draft that agrees with it often, not always)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # default init gives near-uniform logits; sharpen them
        if like is not None:
            model.load_state_dict(like.model.state_dict())
            weight = model.lm_head.weight
            weight.add_(torch.randn_like(weight) * weight.std() * NOISE)
        else:
            model.lm_head.weight.mul_(SHARPEN)
    return LoadedModel(model=model, tokenizer=CharTokenizer(vocab), ref=f"tiny-{seed}",
                       device=torch.device("cpu"), dtype=torch.float32, eos_ids=(),
                       pad_id=0, max_positions=64)


def run(target: LoadedModel, ids: list[int], settings, **kw) -> tuple[Finish, list]:
    events = list(speculative_stream(target, ids, settings, **kw))
    finish = [e for e in events if isinstance(e, Finish)]
    assert len(finish) == 1
    return finish[0], events


# ---------------------------------------------------------------- greedy identity

@needs_models
@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.3, "min_new_tokens": 5}])
def test_draft_equal_to_target_accepts_every_token(stories, extra) -> None:
    settings = resolve_settings({"max_new_tokens": 60, **extra})
    ids = stories.encode("Once upon a time")
    plain = generate(stories, [ids], settings)[0]
    finish, events = run(stories, ids, settings, draft_lm=stories, num_draft_tokens=4)
    assert finish.token_ids == plain.token_ids and finish.text == plain.text
    verifies = [e for e in events if isinstance(e, Verify)]
    assert all(v.accepted == v.proposed for v in verifies)
    assert sum(v.proposed for v in verifies) > 0
    assert summarize(events).acceptance_rate == 1.0


@needs_models
def test_a_one_token_prompt_still_takes_the_lean_forward(stories, xs) -> None:
    """Nothing to prefill: both caches start empty, in the lean forward all the same."""
    settings = resolve_settings({"max_new_tokens": 40})
    ids = [1]
    for lm in (stories, xs):  # the target, and the draft as ModelDrafter.start does
        backend = choose_backend(lm, Request(rows=1, crop=True))
        head = prefill_all_but_last(backend, ids, 64)
        assert head == [] and backend.length == 0
        assert isinstance(backend, (LeanBackend, NativeBackend))  # lean caches, not dynamic
    plain = generate(stories, [ids], settings)[0]
    finish, _ = run(stories, ids, settings, draft_lm=xs, num_draft_tokens=4)
    assert finish.token_ids == plain.token_ids


@needs_models
@pytest.mark.parametrize("adaptive", [False, True])
def test_other_draft_partial_acceptance_same_tokens(stories, xs, adaptive) -> None:
    settings = resolve_settings({"max_new_tokens": 80})
    ids = stories.encode("Once upon a time")
    plain = generate(stories, [ids], settings)[0]
    finish, events = run(stories, ids, settings, draft_lm=xs, num_draft_tokens=4,
                         adaptive=adaptive)
    assert finish.token_ids == plain.token_ids
    assert finish.reason == plain.reason
    s = summarize(events)
    assert 0.0 < s.acceptance_rate < 1.0
    tokens = [e for e in events if isinstance(e, Token)]
    assert {t.draft for t in tokens} == {True, False}
    assert sum(t.draft for t in tokens) == s.accepted or finish.new_tokens < 80


@needs_models
def test_prompt_lookup_greedy_same_tokens_and_stops_like_core(stories) -> None:
    # The story ends with BOS (id 1): finish reason and text must match the core loop.
    settings = resolve_settings({"max_new_tokens": 200, "stop_strings": ["park"]})
    ids = stories.encode("Once upon a time, there was a little girl named Lily. She loved "
                         "to play outside in the park. Once upon a time")
    plain = generate(stories, [ids], settings)[0]
    finish, events = run(stories, ids, settings, prompt_lookup=3)
    assert (finish.token_ids, finish.text, finish.reason) == \
        (plain.token_ids, plain.text, plain.reason)
    assert finish.reason == "stop"
    assert summarize(events).accepted > 5  # the prompt repeats itself: lookup pays


@needs_models
def test_lookup_first_greedy_same_tokens_with_both_drafters_proposing(stories, xs) -> None:
    """--draft-model with --prompt-lookup: lookup proposes where the context has a match
    (no draft forward), the draft model elsewhere; the tokens stay the target's."""
    settings = resolve_settings({"max_new_tokens": 80})
    ids = stories.encode("Once upon a time")
    plain = generate(stories, [ids], settings)[0]
    finish, events = run(stories, ids, settings, draft_lm=xs, prompt_lookup=3)
    assert (finish.token_ids, finish.reason) == (plain.token_ids, plain.reason)
    verifies = [e for e in events if isinstance(e, Verify) and e.proposed]
    by_lookup = [e for e in verifies if e.draft_forwards == 0]
    by_model = [e for e in verifies if e.draft_forwards > 0]
    assert by_lookup and by_model
    assert sum(e.accepted for e in by_lookup) > 0 and sum(e.accepted for e in by_model) > 0


needs_kernels = pytest.mark.skipif(  # float32 and bfloat16 draft weights both need one
    any(kernel.build_for(weights).library is None for weights in kernel.WEIGHTS),
    reason="the native kernel cannot be built here")


def draft_kernel(target: LoadedModel, draft: LoadedModel, **kw) -> str | None:
    """How the draft model's matrices are stored on the native kernel its drafter runs
    (None: another backend)."""
    drafter = make_drafter(target, resolve_settings({}), draft_lm=draft,
                           **{"prompt_lookup": None, **kw})
    if isinstance(drafter, LookupFirstDrafter):
        drafter = drafter.model
    assert isinstance(drafter, ModelDrafter)
    backend = drafter.backend
    return backend.kernel.weights if isinstance(backend, NativeBackend) else None


@needs_models
@needs_kernels
def test_a_draft_model_reads_bfloat16_matrices_where_it_runs_native(stories, xs,
                                                                   monkeypatch) -> None:
    """auto: the draft's matrices in bfloat16 on the native kernel, the model's own
    weights on another backend; float32 and bfloat16 ask the kernel for them, and are
    refused where the draft runs on another backend. The tokens stay the target's."""
    assert draft_kernel(stories, xs) == "bfloat16"
    assert draft_kernel(stories, xs, prompt_lookup=2) == "bfloat16"  # lookup first
    assert draft_kernel(stories, xs, draft_weights="float32") == "float32"
    assert draft_kernel(stories, xs, backend="lean") is None
    with pytest.raises(ConfigError, match=r"--draft-weights bfloat16 is how the native "
                       r"backend stores the draft's matrices, and the draft runs on lean "
                       r"\(asked for with --backend\); use --draft-weights auto or "
                       r"--backend native$"):
        draft_kernel(stories, xs, backend="lean", draft_weights="bfloat16")
    with pytest.raises(ConfigError, match="--draft-weights must be one of auto, float32, "
                                          "bfloat16, got 'half'"):
        draft_kernel(stories, xs, draft_weights="half")
    with pytest.raises(ConfigError, match="--draft-weights bfloat16 sets how the draft "
                                          "model's matrices are stored; give --draft-model"):
        make_drafter(stories, resolve_settings({}), draft_lm=None, prompt_lookup=2,
                     draft_weights="bfloat16")
    monkeypatch.setenv("GENLAB_NATIVE", "0")
    assert draft_kernel(stories, xs) is None
    monkeypatch.delenv("GENLAB_NATIVE")
    settings = resolve_settings({"max_new_tokens": 80})
    ids = stories.encode("Once upon a time")
    plain = generate(stories, [ids], settings)[0]
    for weights, asked in (("float32", {"draft_weights": "float32"}),
                           ("bfloat16", {"draft_weights": "bfloat16"}),
                           ("bfloat16", {}), ("float32", {"backend": "lean"})):
        finish, events = run(stories, ids, settings, draft_lm=xs, **asked)
        assert finish.token_ids == plain.token_ids
        assert 0 < summarize(events).acceptance_rate < 1
        prefill = next(e for e in events if isinstance(e, Prefill))
        assert prefill.draft_weights == weights, asked  # as the drafter that ran has them
    _, lookup_events = run(stories, ids, settings, prompt_lookup=2)
    assert next(e for e in lookup_events if isinstance(e, Prefill)).draft_weights is None


def test_lookup_takes_latest_match_longest_ngram_first() -> None:
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert lookup(ids, 2, 3) == [7, 8, 5]  # (2, 3) occurs twice: the later one wins
    assert lookup([4, 5, 6], 3, 2) == []
    assert lookup([1, 2, 1], 2, 5) == [2, 1]


# ---------------------------------------------------------------- cache rollback

@needs_models
@pytest.mark.parametrize("lookup_first", [False, True])
def test_caches_after_rejections_equal_fresh_prefill(stories, xs, lookup_first) -> None:
    """Both caches hold exactly the committed ids but the last after a run of steps with
    rejections; with lookup first, the draft model's catches up on lookup's tokens."""
    settings = resolve_settings({"max_new_tokens": 60})
    ids = stories.encode("Once upon a time")
    plan = make_plan(stories, settings, 1)
    model = ModelDrafter(xs, choose_backend(xs, Request(rows=1, crop=True)), sample=False)
    drafter = LookupFirstDrafter(PromptLookupDrafter(3), model) if lookup_first else model
    spec = start(stories, choose_backend(stories, Request(rows=1, crop=True)), ids, plan,
                 drafter)
    rejected = lookups = 0
    for _ in range(12):
        result = speculative_step(spec, 4)
        rejected += result.accepted < result.proposed
        lookups += result.proposed > 0 and result.draft_forwards == 0
    assert rejected >= 2
    assert (lookups > 0) == lookup_first
    model.propose(spec.ids, 1, lambda context, logits, i: logits, None)  # the catch-up
    model.commit(spec.ids)
    for lm, backend in ((stories, spec.backend), (xs, model.backend)):
        assert backend.length == len(spec.ids) - 1
        cached = backend.extend(torch.tensor([[spec.ids[-1]]]))[0, -1]
        fresh = transformers_backend(lm.model).prefill_ids(
            torch.tensor([spec.ids]), torch.ones(1, len(spec.ids), dtype=torch.long))[:, -1]
        torch.testing.assert_close(cached, fresh[0], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- distribution

def exact_pairs(target: LoadedModel, prompt: list[int], settings) -> dict[tuple[int, int], float]:
    """P(x1, x2) of plain sampling with `settings`, from the processed target logits."""
    plan = make_plan(target, settings, 1)

    def dist(ids: list[int], step: int) -> torch.Tensor:
        logits = transformers_backend(target.model).prefill_ids(
            torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[:, -1]
        return process(plan, ids, logits[0], step).softmax(-1)

    p1 = dist(prompt, 0)
    return {(a, b): float(p1[a] * pb) for a in range(len(p1)) if p1[a] > 0
            for b, pb in enumerate(dist(prompt + [a], 1).tolist())}


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic, cells with expected count < 5 pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    assert set(counts) <= {k for k, v in probs.items() if v > 0}, "impossible pair drawn"
    for key, p in probs.items():
        expected = p * n
        if expected < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(key, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    return stat, cells - 1


SHARPEN = 6.0
NOISE = 0.7
RUNS = 600


@pytest.mark.parametrize("flags, gamma, drafter", [
    ({"do_sample": True}, 2, "model"),  # no processor chain: a verify processed in one call
    ({"temperature": 0.7}, 1, "model"),
    ({"top_k": 3}, 2, "model"),
    ({"top_p": 0.8, "temperature": 1.3}, 1, "model"),
    ({"temperature": 1.5}, 2, "lookup"),
    ({"temperature": 1.5}, 1, "lookup first"),  # the model, then lookup after a rejection
    # auto gives the model's matrices in bfloat16 where the kernel builds: float32 too
    pytest.param({"temperature": 0.7}, 2, "float32 model", marks=needs_kernels),
])
def test_speculative_sampling_follows_target_distribution(flags, gamma, drafter) -> None:
    """Chi-square goodness of fit of the first two tokens' joint distribution over
    600 seeded runs, at significance 0.001, against the exact processed target law
    (what plain sampling with these settings draws from)."""
    target = tiny_lm(1)
    draft = tiny_lm(2, like=target)
    prompt = [0, 3, 1, 0, 3]  # lookup: the tail (0, 3) recurs, so tokens get drafted
    max_new_tokens = 2
    if drafter == "lookup first":
        # the tail 5 is new, so the model drafts the first token; after a rejection a
        # token the prompt has (0, 1, 3) is looked up and drafts the second; a third
        # token makes room for it, and the first two tokens' law is the same
        prompt, max_new_tokens = [0, 3, 1, 0, 5], 3
    settings = resolve_settings({"max_new_tokens": 2, **flags})
    probs = exact_pairs(target, prompt, settings)
    settings = settings.replace(max_new_tokens=max_new_tokens)
    counts: Counter = Counter()
    rejected = 0
    kw = {"model": {"draft_lm": draft},
          "float32 model": {"draft_lm": draft, "draft_weights": "float32"},
          "lookup": {"prompt_lookup": 2},
          "lookup first": {"draft_lm": draft, "prompt_lookup": 2}}[drafter]
    looked_up = 0
    for seed in range(RUNS):
        finish, events = run(target, prompt, settings.replace(seed=seed),
                             num_draft_tokens=gamma, **kw)
        counts[tuple(finish.token_ids[:2])] += 1
        verifies = [e for e in events if isinstance(e, Verify) and e.proposed]
        rejected += verifies[0].accepted < verifies[0].proposed
        looked_up += any(e.draft_forwards == 0 for e in verifies)
    assert 0.05 * RUNS < rejected < 0.95 * RUNS, "both accept and reject paths must run"
    if drafter == "lookup first":
        assert 0.05 * RUNS < looked_up < 0.95 * RUNS, "both drafters must propose"
    stat, dof = chi_square(counts, probs, RUNS)
    assert stat < chi_square_critical(dof), f"chi2={stat:.1f} dof={dof}"


def test_verify_sampled_on_hand_written_p_and_q() -> None:
    """One position: the token kept (accepted draft or residual draw) follows p, even
    where q puts no mass on tokens p likes (q truncated by top-k)."""
    from genlib.decoding.drafters import Draft
    from genlib.decoding.speculative import verify_sampled

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.0, 0.6, 0.3]])
    generator = torch.Generator().manual_seed(0)
    n = 10000
    counts = Counter()
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=generator))
        accepted, token = verify_sampled(p, Draft([x], q, 0.0, 1), generator)
        counts[x if accepted else token] += 1
    observed = torch.tensor([counts[i] / n for i in range(4)])
    assert (observed - p[0]).abs().max() < 0.02  # > 3.5 standard errors at n = 10,000


def test_draft_distribution_alone_fails_the_same_test() -> None:
    """The test has power: the draft's own law does not pass as the target's."""
    target = tiny_lm(1)
    draft = tiny_lm(2, like=target)
    prompt = [0, 3, 1, 0, 3]
    settings = resolve_settings({"max_new_tokens": 2, "temperature": 0.7})
    probs = exact_pairs(target, prompt, settings)
    wrong = exact_pairs(draft, prompt, settings)
    counts = Counter({k: round(v * RUNS) for k, v in wrong.items()})
    stat, dof = chi_square(counts, {k: probs.get(k, 0.0) + 1e-12 for k in wrong}, RUNS)
    assert stat > chi_square_critical(dof)


# ---------------------------------------------------------------- refusals, helpers

@needs_models
def test_different_vocabularies_refused(stories) -> None:
    code_draft = MODELS / "code-draft"
    if not code_draft.is_dir():
        pytest.skip("code-draft not present")
    draft = load_model(ModelSpec(str(code_draft), device="cpu"))
    settings = resolve_settings({"max_new_tokens": 5})
    with pytest.raises(ModelLoadError, match="does not share the vocabulary"):
        list(speculative_stream(stories, stories.encode("Hi"), settings, draft_lm=draft))


def test_refusals_name_the_fix() -> None:
    target = tiny_lm(1)
    sample = resolve_settings({"max_new_tokens": 3, "num_return_sequences": 2,
                               "temperature": 0.8})
    with pytest.raises(ConfigError, match="batch size 1"):
        list(speculative_stream(target, [1, 2], sample, prompt_lookup=2))
    greedy = resolve_settings({"max_new_tokens": 3})
    with pytest.raises(ConfigError, match="needs a drafter: a draft model"):
        list(speculative_stream(target, [1, 2], greedy))
    with pytest.raises(ModelLoadError, match="vocabulary"):
        list(speculative_stream(target, [1, 2], greedy, draft_lm=tiny_lm(2, vocab=7)))


@needs_models
def test_draft_context_limit_is_named(stories, xs) -> None:
    settings = resolve_settings({"max_new_tokens": 300})  # stories260K: 512, llama2xs: 256
    with pytest.raises(ContextLengthError, match="exceeds the draft model .*'s 256 positions; "
                       r"lower max_new_tokens to 2\d\d or use a draft with a longer context"):
        list(speculative_stream(stories, stories.encode("Hi"), settings, draft_lm=xs))
    # a prompt that alone fills the draft's positions: no "lower to 0" advice
    long_prompt = stories.encode("Once upon a time " * 80)
    assert 256 < len(long_prompt) < 500
    few = resolve_settings({"max_new_tokens": 5})
    with pytest.raises(ContextLengthError) as caught:
        list(speculative_stream(stories, long_prompt, few, draft_lm=xs))
    assert "fills the draft model" in str(caught.value) and "256 positions" in str(caught.value)
    assert "lower max_new_tokens" not in str(caught.value)


@needs_models
def test_a_draft_model_adapts_gamma_unless_told_not_to(stories, xs) -> None:
    settings = resolve_settings({"max_new_tokens": 80})
    ids = stories.encode("Once upon a time")

    def proposed(**kw) -> list[int]:
        """Tokens drafted per verify, while the budget left room for a full draft."""
        _, events = run(stories, ids, settings, draft_lm=xs, num_draft_tokens=4, **kw)
        done, out = 0, []
        for verify in (e for e in events if isinstance(e, Verify)):
            if settings.max_new_tokens - done > 8:
                out.append(verify.proposed)
            done += verify.accepted + 1
        return out

    default = proposed()
    assert len(set(default)) > 1 and default == proposed(adaptive=True)
    assert set(proposed(adaptive=False)) == {4}
    # prompt lookup keeps a fixed gamma unless asked: its default drafts as --fixed does
    lookup = resolve_settings({"max_new_tokens": 120})

    def looked_up(**kw) -> list[int]:
        _, events = run(stories, ids, lookup, prompt_lookup=3, **kw)
        return [e.proposed for e in events if isinstance(e, Verify)]

    fixed = looked_up(adaptive=False)
    assert max(fixed) == 10 and looked_up() == fixed != looked_up(adaptive=True)


@needs_models
@pytest.mark.parametrize("flags, step", [
    ({"ignore_eos": True}, 0),  # EOS suppressed at every position: one call
    ({"min_new_tokens": 5}, 1),  # steps 1-4, all before min_new_tokens: one call
    ({"min_new_tokens": 5}, 2),  # steps 2-5: the last is step 5, not suppressed
    ({"min_new_tokens": 5}, 3),  # suppressed at the first two of four only
    ({"min_new_tokens": 5}, 5),  # at none: one call
    ({}, 0),  # no EOS suppression at all: the logits as they are
    ({"repetition_penalty": 1.3, "min_new_tokens": 2}, 0),  # a chain: position by position
])
def test_a_verify_block_is_processed_as_its_positions_one_by_one(stories, flags, step):
    settings = resolve_settings({"max_new_tokens": 20, **flags})
    plan = make_plan(stories, settings, 1)
    ids, drafted = stories.encode("Once upon a time"), [300, 301, 302]
    logits = torch.randn(len(drafted) + 1, stories.vocab_size)
    expected = torch.stack([process(plan, [*ids, *drafted[:i]], logits[i], step + i)
                            for i in range(len(logits))])
    got = process_block(plan, ids, drafted, logits, step)
    assert torch.equal(got, expected)
    eos = list(stories.eos_ids)
    suppressed = (got[:, eos] == float("-inf")).all(dim=-1).tolist()
    assert suppressed == [settings.ignore_eos or step + i < settings.min_new_tokens
                          for i in range(len(logits))]


@needs_models
@pytest.mark.parametrize("flags, step, draws", [
    ({"ignore_eos": True}, 0, 4),
    ({"min_new_tokens": 5}, 3, 2),  # steps 3 and 4 of 3-6
    ({"min_new_tokens": 5}, 5, 0),
    ({"ignore_eos": True, "min_new_tokens": 5}, 3, 4),
    ({}, 0, None),  # nothing banned: Bans()
    ({"temperature": 0.5, "top_k": 3, "do_sample": False}, 0, None),  # greedy: no sampling stage
    ({"repetition_penalty": 1.3}, 0, "chain"),
    ({"no_repeat_ngram_size": 2}, 0, "chain"),
    ({"logit_bias": {5: 2.0}}, 0, "chain"),
    ({"dry_multiplier": 0.8}, 0, "chain"),
])
def test_draft_bans_say_what_process_does_to_a_draft(stories, flags, step, draws):
    """Where no processor chain runs, `draft_bans` is `process` at each of a draft's four
    positions: the end ids at -inf at the first `draws` of them, nothing else changed;
    None where a chain runs."""
    settings = resolve_settings({"max_new_tokens": 20, **flags})
    plan = make_plan(stories, settings, 1)
    bans = draft_bans(plan, step, 4)
    if draws == "chain":
        assert bans is None
        return
    assert bans == (Bans() if draws is None else Bans(tuple(stories.eos_ids), draws))
    ids = stories.encode("Once upon a time")
    for i in range(4):
        logits = torch.randn(stories.vocab_size)
        banned = logits.clone()
        if i < bans.draws:
            banned[list(bans.ids)] = -math.inf
        assert torch.equal(process(plan, ids, logits, step + i), banned)


def test_a_model_without_end_ids_bans_nothing():
    lm = tiny_lm(1)
    assert lm.eos_ids == ()
    plan = make_plan(lm, resolve_settings({"max_new_tokens": 8, "ignore_eos": True}), 1)
    assert draft_bans(plan, 0, 3) == Bans()


@needs_models
@needs_kernels
@pytest.mark.parametrize("lookup", [None, 2])
@pytest.mark.parametrize("flags", [{"min_new_tokens": 40}, {"ignore_eos": True}, {}])
def test_a_native_draft_model_drafts_in_one_call(stories, xs, monkeypatch, flags, lookup):
    """Greedy with no processor chain: each draft of the model (where lookup, asked
    first, finds nothing) is one `draft_greedy` call on its native backend, its bans
    those of the positions it drafts; it proposes what the drafter's loop of one forward
    a token proposes, in as many forwards, and the tokens stay plain greedy's."""
    settings = resolve_settings({"max_new_tokens": 80, **flags})
    ids = stories.encode("Once upon a time")
    calls = []
    whole = NativeBackend._draft_greedy
    monkeypatch.setattr(NativeBackend, "_draft_greedy",
                        lambda self, *a: calls.append(a) or whole(self, *a))
    finish, events = run(stories, ids, settings, draft_lm=xs, prompt_lookup=lookup)
    verifies = [(e.proposed, e.accepted, e.draft_forwards) for e in events
                if isinstance(e, Verify)]
    model_drafts = [v for v in verifies if v[2] > 0]
    assert len(calls) == len(model_drafts) > 0
    generated, expected = 0, []
    for _, accepted, forwards in verifies:
        if forwards:
            gamma = calls[len(expected)][1]
            ban = min(gamma, max(0, settings.min_new_tokens - generated))
            expected.append(gamma if settings.ignore_eos else ban)
        generated += accepted + 1
    assert [bans.draws for _, _, bans in calls] == expected
    eos = tuple(stories.eos_ids) if settings.ignore_eos or settings.min_new_tokens else ()
    assert all(bans.ids == eos for _, _, bans in calls)
    assert finish.token_ids == generate(stories, [ids], settings)[0].token_ids
    monkeypatch.setattr(NativeBackend, "capabilities",
                        replace(NativeBackend.capabilities, greedy_draft=False))
    by_step, step_events = run(stories, ids, settings, draft_lm=xs, prompt_lookup=lookup)
    assert len(calls) == len(model_drafts)  # the loop ran instead
    assert [(e.proposed, e.accepted, e.draft_forwards) for e in step_events
            if isinstance(e, Verify)] == verifies
    assert by_step.token_ids == finish.token_ids


@needs_models
@needs_kernels
def test_a_draft_with_a_chain_or_sampled_runs_one_forward_a_token(stories, xs, monkeypatch):
    """A processor chain, or sampling, takes the drafter's own loop (the C draft knows
    bans only, and draws no samples), though the draft runs native; a backend without
    whole drafts refuses one."""
    monkeypatch.setattr(NativeBackend, "_draft_greedy",
                        lambda *a: pytest.fail("a whole draft under a chain or sampling"))
    ids = stories.encode("Once upon a time")
    for flags in ({"repetition_penalty": 1.3}, {"do_sample": True, "seed": 3}):
        settings = resolve_settings({"max_new_tokens": 30, **flags})
        finish, events = run(stories, ids, settings, draft_lm=xs)
        assert finish.new_tokens == 30
        prefill = next(e for e in events if isinstance(e, Prefill))
        assert prefill.draft_weights == "bfloat16"  # the native kernel's: it could
    lean = LeanBackend(xs, lean_model_of(xs))
    with pytest.raises(ConfigError, match="the lean backend draws a greedy draft one "
                                          "forward at a time; use --backend native"):
        lean.draft_greedy([1], 3, Bans())


@needs_kernels
def test_a_nan_logit_ends_a_draft_in_the_loop_and_in_one_call_alike():
    """torch's max is NaN where any logit is: the drafter's loop ends its draft after the
    forward that gave it, and the whole draft in one call ends there too."""
    lm = tiny_lm(2)
    with torch.no_grad():
        lm.model.lm_head.weight[3] = float("nan")
    for whole in (False, True):
        backend = choose_backend(lm, Request(rows=1, crop=True))
        assert backend.capabilities.greedy_draft  # native, where the one call could run
        drafter = ModelDrafter(lm, backend, sample=False)
        drafter.start([1, 2, 4])
        draft = drafter.propose([1, 2, 4], 4, lambda context, logits, i: logits, None,
                                Bans() if whole else None)
        assert (draft.tokens, draft.forwards) == ([], 1), whole
        assert drafter.cached == [1, 2, 4] and backend.length == 3


def test_adaptive_gamma_and_predicted_speedup() -> None:
    schedule = GammaSchedule(4, adaptive=True)
    schedule.update(4, 4)
    assert schedule.gamma == 6
    schedule.update(6, 2)
    assert schedule.gamma == 5
    fixed = GammaSchedule(4)
    fixed.update(4, 0)
    assert fixed.gamma == 4
    # Leviathan et al. Table/Fig.: alpha 0.8, gamma 5, c 0 -> (1 - 0.8^6) / 0.2
    assert predicted_speedup(0.8, 5, 0.0) == pytest.approx((1 - 0.8 ** 6) / 0.2)
    assert predicted_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)


def test_summary_prediction_sums_the_formula_over_each_steps_gamma():
    # alpha = 3 / (3 + 1); c = (1.5 s / 6 forwards) / (1.5 s / 3 steps) = 0.5
    run = Summary(steps=3, accepted=3, rejections=1, draft_seconds=1.5, draft_forwards=6,
                  target_seconds=1.5, gammas=[4, 0, 2])
    tokens = sum((1 - 0.75 ** (g + 1)) / 0.25 for g in (4, 0, 2))
    cost = (4 * 0.5 + 1) + 1 + (2 * 0.5 + 1)
    assert run.predicted_speedup() == pytest.approx(tokens / cost)
    assert run.predicted_speedup(verify_cost=2.0) == pytest.approx(tokens / cost / 2)
    # a verify took 1.5 s / 3 = 0.5 s; plain decoding at 4 tok/s takes 0.25 s a step
    assert run.verify_cost(4.0) == pytest.approx(2.0)
    assert Summary().verify_cost(4.0) == 0.0
    # Not the formula at the mean gamma (2): steps without a draft count as they were.
    assert run.predicted_speedup() != pytest.approx(predicted_speedup(0.75, 2, 0.5))
    assert Summary().predicted_speedup() == 0.0
    # lookup first: lookup drafted the 4 tokens, the model the 2 (2 forwards); the
    # lookup step costs one target forward, no draft forward
    mixed = replace(run, draft_seconds=0.5, draft_forwards=2)
    assert mixed.predicted_speedup() == pytest.approx(tokens / (1 + 1 + (2 * 0.5 + 1)))


# ---------------------------------------------------------------- CLI

@needs_models
def test_cli_speculate_json_matches_baseline() -> None:
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, [
        "speculate", "Once upon a time", "-m", str(MODELS / "stories260K"),
        "--draft-model", str(MODELS / "llama2xs"), "-n", "40", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    (out,) = data["outputs"]
    assert out["token_ids"] == data["baseline"]["token_ids"] and data["baseline"]["identical"]
    assert out["text"].startswith(", there was a little girl named Lily")
    assert data["prompt_tokens"] == 5
    stats = data["speculation"]
    assert 0 < stats["acceptance_rate"] < 1
    assert stats["proposed"] >= stats["accepted"] > 0
    assert data["speedup"] > 0 and data["predicted_speedup"] > 0
    assert data["adaptive"] is True and data["num_draft_tokens"] == 5  # a draft model's defaults
    assert stats["mean_num_draft_tokens"] != 5


@needs_models
def test_cli_draft_model_with_prompt_lookup_drafts_lookup_first() -> None:
    """Both drafter flags: lookup first, the draft model where nothing matches; named so
    in the JSON, with a draft model's defaults, and the baseline's tokens."""
    from typer.testing import CliRunner

    from cli.main import app

    lookup = "--prompt-lookup"
    result = CliRunner().invoke(app, [
        "speculate", "Once upon a time", "-m", str(MODELS / "stories260K"),
        "--draft-model", str(MODELS / "llama2xs"), lookup, "2", "-n", "60", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["drafter"] == f"prompt-lookup (n=2), then {MODELS / 'llama2xs'}"
    assert data["outputs"][0]["token_ids"] == data["baseline"]["token_ids"]
    assert data["adaptive"] is True and data["num_draft_tokens"] == 5
    stats = data["speculation"]
    assert stats["accepted"] > 0
    # the model drafted, and lookup drafted some tokens with no draft forward
    assert 0 < stats["draft_forwards"] < stats["proposed"]


@needs_models
@needs_kernels
def test_cli_says_how_the_draft_models_matrices_were_stored() -> None:
    """The JSON's `draft_weights` and the report's drafter line; --draft-weights without
    a draft model is an input error that says so."""
    from typer.testing import CliRunner

    from cli.main import app

    base = ["speculate", "Once upon a time", "-m", str(MODELS / "stories260K"), "-n", "20"]
    draft = ["--draft-model", str(MODELS / "llama2xs")]
    for flags, weights in (([], "bfloat16"), (["--draft-weights", "float32"], "float32")):
        result = CliRunner().invoke(app, base + draft + flags + ["--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["draft_weights"] == weights
        assert data["outputs"][0]["token_ids"] == data["baseline"]["token_ids"]
    result = CliRunner().invoke(app, base + draft)
    assert f"drafter {MODELS / 'llama2xs'} (bfloat16 weights)" in result.stderr
    lookup = CliRunner().invoke(app, base + ["--prompt-lookup", "2", "--json"])
    assert json.loads(lookup.stdout)["draft_weights"] is None
    refused = CliRunner().invoke(app, base + ["--prompt-lookup", "2", "--draft-weights",
                                              "bfloat16"])
    assert refused.exit_code == 2
    assert refused.stderr.strip() == (
        "error: --draft-weights bfloat16 sets how the draft model's matrices are stored; "
        "give --draft-model too, or drop it")


@needs_models
def test_cli_refuses_mismatched_draft_with_exit_2() -> None:
    from typer.testing import CliRunner

    from cli.main import app

    if not (MODELS / "code-draft").is_dir():
        pytest.skip("code-draft not present")
    result = CliRunner().invoke(app, [
        "speculate", "Once", "-m", str(MODELS / "stories260K"),
        "--draft-model", str(MODELS / "code-draft"), "-n", "5"])
    assert result.exit_code == 2
    assert "does not share the vocabulary" in result.stderr
    assert "Traceback" not in result.output


@needs_models
def test_cli_logprobs_are_on_the_output_in_every_form() -> None:
    """--logprobs N, as generate's: the output's `logprobs` object (--json and each
    --jsonl line), the table on stderr in text mode; the same tokens as generate's."""
    from typer.testing import CliRunner

    from cli.main import app

    base = ["Once upon a time", "-m", str(MODELS / "stories260K"), "-n", "12",
            "--logprobs", "2"]
    spec = [*base, "--draft-model", str(MODELS / "llama2xs"), "--no-baseline"]
    plain = json.loads(CliRunner().invoke(app, ["generate", *base, "--json"]).stdout)
    result = CliRunner().invoke(app, ["speculate", *spec, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (out,) = doc["outputs"]
    assert "logprobs" not in doc
    content = out["logprobs"]["content"]
    assert [e["id"] for e in content] == out["token_ids"] == plain["outputs"][0]["token_ids"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    expected = [e["logprob"] for e in plain["outputs"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in content] == pytest.approx(expected, abs=1e-4)

    lines = CliRunner().invoke(app, ["speculate", *spec, "--jsonl"])
    assert lines.exit_code == 0, lines.output
    (line,) = [json.loads(text) for text in lines.stdout.splitlines()]
    assert line["logprobs"] == out["logprobs"]

    text = CliRunner().invoke(app, ["speculate", *spec])
    assert text.exit_code == 0, text.output
    assert "logprobs (raw model / processed)" in text.stderr
    assert "' there'" in text.stderr


@needs_models
def test_cli_truncate_prompt_fits_the_draft_too(stories) -> None:
    """--truncate-prompt keeps the prompt's last tokens that fit both models: llama2xs,
    the draft, has 256 positions to stories260K's 512."""
    from typer.testing import CliRunner

    from cli.main import app

    prompt = "Once upon a time " * 80
    ids = stories.encode(prompt)
    assert 256 < len(ids) < 500 and ids[0] == stories.tokenizer.bos_token_id
    result = CliRunner().invoke(app, [
        "speculate", prompt, "-m", str(MODELS / "stories260K"),
        "--draft-model", str(MODELS / "llama2xs"), "-n", "16", "--truncate-prompt",
        "--no-baseline", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["prompt_tokens"] == 256 - 16
    kept = ids[:1] + ids[len(ids) - 239:]  # BOS, then the last tokens
    plain = generate(stories, [kept], resolve_settings({"max_new_tokens": 16}))[0]
    assert doc["outputs"][0]["token_ids"] == list(plain.token_ids)


@needs_models
@pytest.mark.parametrize("swap, identical", [(None, True), (3, False)])
def test_cli_greedy_identity_holds_on_what_max_time_left(monkeypatch, swap, identical):
    """--max-time stops the speculative run and the baseline at different tokens: the
    verdict compares the tokens both made (a plain run cut after 5 tokens is not a
    difference), and still catches a different token among them."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from cli import speculate
    from cli.main import app

    real = speculate.run_baseline

    def cut_by_time(*args):
        finish, tps = real(*args)
        ids = list(finish.token_ids[:5])
        if swap is not None:
            ids[swap] += 1
        return replace(finish, token_ids=tuple(ids), reason="time"), tps

    monkeypatch.setattr(speculate, "run_baseline", cut_by_time)
    args = ["speculate", "Once upon a time", "-m", str(MODELS / "stories260K"),
            "--draft-model", str(MODELS / "llama2xs"), "-n", "20", "--max-time", "60"]
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert len(doc["outputs"][0]["token_ids"]) == 20
    assert doc["baseline"]["identical"] is identical
    text = CliRunner().invoke(app, args)
    assert text.exit_code == 0, text.output
    verdict = "yes (up to token 5, where --max-time stopped" if identical else "NO"
    report = " ".join(text.stderr.split())  # as read, wherever the terminal's width wrapped it
    assert f"greedy output identical to plain decoding: {verdict}" in report



@needs_models
def test_cli_rehearses_both_runs_before_timing_either(monkeypatch):
    """First-call costs fall on neither timed run: a short untimed speculative run and a
    short plain run come before the timed speculative run and the timed baseline."""
    from typer.testing import CliRunner

    import genlib.generate
    from cli.main import app

    real = genlib.generate.stream
    calls: list[tuple[str, int]] = []

    def spy(lm, prompts, settings, **kwargs):
        kind = "plain" if kwargs.get("drafter") is None else "speculative"
        calls.append((kind, settings.max_new_tokens))
        return real(lm, prompts, settings, **kwargs)

    monkeypatch.setattr(genlib.generate, "stream", spy)
    result = CliRunner().invoke(app, [
        "speculate", "Once upon a time", "-m", str(MODELS / "stories260K"),
        "--draft-model", str(MODELS / "llama2xs"), "-n", "20", "--json"])
    assert result.exit_code == 0, result.output
    assert calls == [("speculative", 8), ("plain", 8), ("speculative", 20), ("plain", 20)]


@needs_models
def test_cli_speed_leaves_out_the_time_spent_printing(monkeypatch):
    """The baseline prints nothing, so the speculative run's streamed printing is kept
    out of its timing: a terminal that takes 0.5 s a token does not make it slow."""
    import re

    from typer.testing import CliRunner

    from cli import render
    from cli.main import app

    real = render.stream_text

    def slow_terminal(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(render, "stream_text", slow_terminal)
    result = CliRunner().invoke(app, [
        "speculate", "Once upon a time", "-m", str(MODELS / "stories260K"),
        "--draft-model", str(MODELS / "llama2xs"), "-n", "6", "--no-baseline"])
    assert result.exit_code == 0, result.output
    report = " ".join(result.stderr.split())  # wherever the terminal's width wrapped it
    speed = float(re.search(r"speed ([\d.]+) tok/s", report).group(1))
    assert speed > 6 / 1.5  # printing alone took 3 s: 2 tok/s at most when counted
