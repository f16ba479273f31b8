"""Per-step detail (genlib.decoding.detail) on the one event stream: the recorded final
distribution is the tensor the sampler drew from; each stage's removals on hand-built
logits; --logprobs values against transformers' compute_transition_scores; branches
keep the random stream; inverse-CDF (common random numbers) sampling follows the
processed distribution."""

from __future__ import annotations

import math

import pytest
import torch

from genlib.decoding import detail as stepdetail
from genlib.decoding.detail import Detail
from genlib.events import Finish, Token
from genlib.generate import stream
from genlib.lab.explain import divergence, explain
from genlib.sampling import draws as sampling
from genlib.sampling import processors
from genlib.settings import config
from genlib.settings.config import resolve_settings


def tokens_of(lm, ids, settings, detail):
    return [e for e in stream(lm, [ids], settings, detail=detail) if isinstance(e, Token)]


@pytest.mark.parametrize("crn", [True, False])
def test_recorded_final_distribution_is_the_tensor_sampled_from(stories, monkeypatch, crn):
    seen: list[torch.Tensor] = []
    real_pick, real_rows = sampling.pick_by_uniform, sampling.sample_rows

    def pick(logits, u):
        seen.append(logits)
        return real_pick(logits, u)

    def rows(sampler, logits, generators):
        seen.append(logits)
        return real_rows(sampler, logits, generators)

    monkeypatch.setattr(sampling, "pick_by_uniform", pick)
    monkeypatch.setattr(sampling, "sample_rows", rows)
    settings = resolve_settings({"temperature": 0.8, "top_k": 12, "top_p": 0.9,
                                 "max_new_tokens": 6, "seed": 5})
    events = tokens_of(stories, stories.encode("Once upon a time"), settings,
                       Detail(stages=True, inverse_cdf=crn))
    assert len(seen) == len(events) == 6
    for event, used in zip(events, seen):
        final = event.detail.final
        assert final.data_ptr() == used[0].data_ptr() and torch.equal(final, used[0])
        assert [s.name for s in event.detail.stages] == ["raw", "temperature", "top_k",
                                                          "top_p"]
        assert (event.detail.draw is not None) == crn


def hand_built_step(settings, probs):
    chain = processors.build_processors(settings)
    logits = torch.tensor([probs]).log()
    stages = stepdetail.run_stages(chain, None, torch.tensor([[0]]), logits)
    (detail,) = stepdetail.details(stages, torch.tensor([0]), None,
                                   Detail(logprobs=len(probs), stages=True), [False])
    return detail


def test_each_stage_removals_on_hand_built_logits():
    # top-k 3 drops the 0.05 token; renormalised (.526, .316, .158), top-p 0.7 keeps
    # .526 + .316 and drops the .158 one; min-p 0.7 then drops .375 < .7 * .625.
    settings = resolve_settings({"top_k": 3, "top_p": 0.7, "min_p": 0.7})
    detail = hand_built_step(settings, [0.5, 0.3, 0.15, 0.05])
    by_id = {c.token_id: c for c in detail.top}
    assert by_id[3].removed_by == "top_k" and by_id[2].removed_by == "top_p"
    assert by_id[1].removed_by == "min_p" and by_id[0].removed_by is None
    effects = {s.name: s for s in detail.stages}
    assert effects["top_k"].removed_mass == pytest.approx(0.05, abs=1e-6)
    assert effects["top_p"].removed_mass == pytest.approx(0.15 / 0.95, abs=1e-6)
    assert effects["min_p"].removed_mass == pytest.approx(0.3 / 0.8, abs=1e-6)
    assert [s.kept for s in detail.stages] == [4, 3, 2, 1]
    assert by_id[0].stage_probs == pytest.approx((0.5, 0.5 / 0.95, 0.5 / 0.8, 1.0))
    assert detail.entropy == pytest.approx(0.0, abs=1e-6)
    raw_entropy = -sum(p * math.log(p) for p in (0.5, 0.3, 0.15, 0.05))
    assert detail.stages[0].entropy == pytest.approx(raw_entropy, abs=1e-5)
    assert detail.chosen.processed_logprob == pytest.approx(0.0, abs=1e-6)


def test_temperature_and_penalty_remove_nothing_but_reshape():
    settings = resolve_settings({"temperature": 0.5})
    detail = hand_built_step(settings, [0.6, 0.4])
    temp = detail.stages[1]
    assert temp.name == "temperature" and temp.removed_mass == 0 and temp.kept == 2
    assert detail.top[0].stage_probs[1] == pytest.approx(0.36 / 0.52, abs=1e-6)


def test_logprobs_equal_transformers_transition_scores(stories):
    settings = resolve_settings({"strategy": "greedy", "repetition_penalty": 1.3,
                                 "max_new_tokens": 10})
    ids = stories.encode("Once upon a time")
    events = tokens_of(stories, ids, settings, Detail(logprobs=3))
    out = stories.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10,
                                 repetition_penalty=1.3, output_scores=True,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
    new = out.sequences[0, len(ids):].tolist()
    assert [e.token_id for e in events] == new[:len(events)]
    processed = stories.model.compute_transition_scores(out.sequences, out.scores,
                                                        normalize_logits=True)[0]
    raw = stories.model.compute_transition_scores(out.sequences, out.logits,
                                                  normalize_logits=True)[0]
    for i, e in enumerate(events):
        assert e.detail.chosen.logprob == pytest.approx(float(raw[i]), abs=1e-4)
        assert e.logprob == pytest.approx(float(raw[i]), abs=1e-4)
        assert e.detail.chosen.processed_logprob == pytest.approx(float(processed[i]),
                                                                  abs=1e-4)
        top = out.logits[i][0].float().log_softmax(-1).topk(3)
        assert [c.token_id for c in e.detail.top] == top.indices.tolist()
        assert [c.logprob for c in e.detail.top] == pytest.approx(top.values.tolist(),
                                                                  abs=1e-4)
    assert any(abs(e.detail.chosen.logprob - e.detail.chosen.processed_logprob) > 1e-3
               for e in events)  # the penalty changed something: the two are not one value


def test_no_detail_means_no_record(stories):
    settings = resolve_settings({"max_new_tokens": 3})
    events = tokens_of(stories, stories.encode("Once"), settings, None)
    assert all(e.detail is None for e in events)


def test_branch_reproduces_the_original_up_to_the_step_then_differs(stories):
    settings = resolve_settings({"temperature": 1.0, "max_new_tokens": 12, "seed": 7,
                                 "ignore_eos": True})
    ids = stories.encode("Once upon a time")
    original = explain(stories, ids, settings, top=5)
    step = 3
    alternative = next(c.token_id for c in original.tokens[step].detail.top
                       if c.token_id != original.ids[step])
    branch = explain(stories, ids, settings, top=5, force={step: alternative})
    assert branch.ids[:step] == original.ids[:step]
    assert branch.ids[step] == alternative and branch.tokens[step].detail.forced
    assert divergence(original.ids, branch.ids) == step
    assert branch.ids[step + 1:] != original.ids[step + 1:]
    # the same random stream: every step drew the same uniform in both runs
    assert [t.detail.draw for t in branch.tokens] == [t.detail.draw for t in original.tokens]


def test_pick_by_uniform_never_picks_a_removed_token():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf"), float("-inf")]])
    for u in (0.0, 0.49999, 0.5, 0.9999999, 1.0 - 2 ** -24):
        token = int(sampling.pick_by_uniform(logits, torch.tensor([u])))
        assert token in (0, 2)
    assert int(sampling.pick_by_uniform(logits, torch.tensor([0.25]))) == 0
    assert int(sampling.pick_by_uniform(logits, torch.tensor([0.75]))) == 2


@pytest.mark.parametrize("flags", [{"temperature": 0.7}, {"top_k": 8}, {"top_p": 0.8}])
def test_crn_samples_follow_processed_distribution(stories, flags):
    """As test_processors' test for the default sampler: 2000 seeded rows' first tokens
    by inverse CDF are within total variation 0.06 of the processed distribution."""
    rows = 2000
    settings = resolve_settings({**flags, "max_new_tokens": 1, "seed": 321})
    ids = stories.encode("Once upon a time, there was a")
    finishes = [e for e in stream(stories, [ids] * rows, settings,
                                  seeds=[config.derive_seed(321, i) for i in range(rows)],
                                  detail=Detail(record=False, inverse_cdf=True))
                if isinstance(e, Finish)]
    counts = torch.bincount(torch.tensor([f.token_ids[0] for f in finishes]),
                            minlength=stories.vocab_size).float()
    with torch.no_grad():
        logits = stories.model(torch.tensor([ids])).logits[:, -1].float()
    chain = processors.build_processors(settings)
    expected = processors.apply(chain, torch.tensor([ids]), logits).softmax(-1)[0]
    assert counts[expected == 0].sum() == 0
    tv = 0.5 * (counts / rows - expected).abs().sum().item()
    assert tv < 0.06, tv


def test_crn_gives_two_settings_the_same_draws(stories):
    ids = stories.encode("Once upon a time")
    draws = []
    for flags in ({"temperature": 0.7}, {"top_k": 5, "temperature": 1.3}):
        settings = resolve_settings({**flags, "max_new_tokens": 5, "seed": 11,
                                     "ignore_eos": True})
        events = tokens_of(stories, ids, settings, Detail(inverse_cdf=True))
        draws.append([e.detail.draw for e in events])
    assert draws[0] == draws[1] and len(set(draws[0])) == 5


@pytest.mark.parametrize("crn", [True, False])
def test_compare_draws_by_inverse_cdf_with_crn_only(stories, crn):
    from genlib.lab.compare import build_strategies, compare, sharing_seed

    strategies = sharing_seed(build_strategies([], ["temperature=1.2", "top_k=20"],
                                               {"max_new_tokens": 8, "ignore_eos": True}), 9)
    ids = stories.encode("Once upon a time")
    comparison = compare(stories, ids, strategies, seed=9, crn=crn)
    assert comparison.to_dict()["random_draws"] == ("common (inverse CDF)" if crn
                                                    else "independent")
    for strategy, result in zip(strategies, comparison.results):
        detail = Detail(record=False, inverse_cdf=True) if crn else None
        expected = [e.token_id for e in tokens_of(stories, ids, strategy.settings, detail)]
        assert list(result.samples[0].token_ids) == expected


def test_speculative_logprobs_equal_the_plain_loops(stories):
    """Greedy speculation (prompt lookup) emits the plain loop's tokens; their records
    (raw and processed logprobs, alternatives) must be the plain loop's too."""
    from genlib.decoding.speculative import Drafting

    settings = resolve_settings({"strategy": "greedy", "repetition_penalty": 1.2,
                                 "max_new_tokens": 12})
    ids = stories.encode("Once upon a time, there was a little girl. Once upon a time")
    plain = tokens_of(stories, ids, settings, Detail(logprobs=3))
    spec = [e for e in stream(stories, [ids], settings, drafter=Drafting(prompt_lookup=2),
                              detail=Detail(logprobs=3)) if isinstance(e, Token)]
    assert [e.token_id for e in spec] == [e.token_id for e in plain]
    assert any(e.draft for e in spec)  # some tokens came from accepted drafts
    for a, b in zip(spec, plain):
        assert a.detail.chosen.logprob == pytest.approx(b.detail.chosen.logprob, abs=1e-4)
        assert a.detail.chosen.processed_logprob == pytest.approx(
            b.detail.chosen.processed_logprob, abs=1e-4)
        assert [c.token_id for c in a.detail.top] == [c.token_id for c in b.detail.top]


def test_detail_path_runs_the_full_chain_and_observes_mirostat(stories):
    """The recorded path (stages one at a time, Mirostat observing the draw after it)
    draws what the unrecorded inverse-CDF loop draws, with penalties counting only the
    generated columns (prompt_width) and every new stage shown by name."""
    settings = resolve_settings({"temperature": 0.9, "presence_penalty": 0.8,
                                 "logit_bias": {"7": -2.0}, "mirostat": 2,
                                 "mirostat_tau": 3.0, "seed": 5, "max_new_tokens": 12})
    ids = stories.encode("Once upon a time")
    plain = tokens_of(stories, ids, settings, Detail(record=False, inverse_cdf=True))
    run = explain(stories, ids, settings, top=3)
    assert run.ids == [t.token_id for t in plain]
    names = [s.name for s in run.tokens[0].detail.stages]
    assert names == ["raw", "logit_bias", "penalties", "temperature", "mirostat"]
    # Mirostat's mu moves with what was drawn: later steps keep a different set.
    kept = {t.detail.stages[-1].kept for t in run.tokens}
    assert len(kept) > 1
