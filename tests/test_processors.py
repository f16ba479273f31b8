"""Processors on hand-written vectors, against transformers' own processors, and a
statistical test that sampled tokens follow the processed distribution."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import logits_process as hf

from genlib import generate
from genlib.decoding.step import make_plan
from genlib.errors import ConfigError
from genlib.sampling import processors
from genlib.settings import config
from genlib.settings.config import resolve_settings

NEG = float("-inf")


def probs(values: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly `values` (they sum to 1)."""
    return torch.tensor([values]).log()


def kept(logits: torch.Tensor) -> list[bool]:
    return torch.isfinite(logits[0]).tolist()


def test_top_k_keeps_k_most_probable():
    out = processors.top_k(2)(None, probs([0.1, 0.5, 0.3, 0.1]))
    assert kept(out) == [False, True, True, False]


def test_top_p_keeps_smallest_set_reaching_p():
    # sorted: 0.5, 0.3 (=0.8 >= 0.75), so 0.1 and 0.1 go
    out = processors.top_p(0.75)(None, probs([0.1, 0.5, 0.3, 0.1]))
    assert kept(out) == [False, True, True, False]
    # p = 1 keeps everything; a tiny p keeps only the top token
    assert all(kept(processors.top_p(1.0)(None, probs([0.1, 0.5, 0.3, 0.1]))))
    assert kept(processors.top_p(0.01)(None, probs([0.1, 0.5, 0.3, 0.1]))) == \
        [False, True, False, False]


def test_min_p_drops_below_fraction_of_max():
    # p_max = 0.5, min_p 0.5 -> threshold 0.25: keeps 0.5 and 0.3
    out = processors.min_p(0.5)(None, probs([0.1, 0.5, 0.3, 0.1]))
    assert kept(out) == [False, True, True, False]


def test_temperature_sharpens_and_flattens():
    logits = probs([0.2, 0.8])
    sharp = processors.temperature(0.5)(None, logits).softmax(-1)[0]
    flat = processors.temperature(2.0)(None, logits).softmax(-1)[0]
    assert sharp[1] > 0.8 > flat[1] > 0.5
    assert sharp[1].item() == pytest.approx(0.64 / (0.64 + 0.04))


def test_repetition_penalty_math_and_ignores_padding():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    ids = torch.tensor([[-1, -1, 0, 1]])  # two left-padding slots, then tokens 0 and 1
    out = processors.repetition_penalty(2.0)(ids, logits)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, 0.5]]  # input not modified


def test_no_repeat_ngram_bans_completion_of_seen_ngram():
    ids = torch.tensor([[5, 6, 7, 5, 6]])  # bigram-prefix (5,6) was followed by 7
    out = processors.no_repeat_ngram(3)(ids, torch.zeros(1, 10))
    assert kept(out) == [i != 7 for i in range(10)]


def test_suppress_tokens():
    out = processors.suppress_tokens([1, 2])(None, torch.zeros(1, 4))
    assert kept(out) == [True, False, False, True]


HF_PAIRS = [
    (processors.temperature(0.7), hf.TemperatureLogitsWarper(0.7)),
    (processors.top_k(20), hf.TopKLogitsWarper(20)),
    (processors.top_p(0.8), hf.TopPLogitsWarper(0.8)),
    (processors.min_p(0.1), hf.MinPLogitsWarper(0.1)),
    (processors.typical_p(0.9), hf.TypicalLogitsWarper(0.9)),
    (processors.repetition_penalty(1.3), hf.RepetitionPenaltyLogitsProcessor(1.3)),
    (processors.no_repeat_ngram(2), hf.NoRepeatNGramLogitsProcessor(2)),
]


# Beam sampling's min_tokens_to_keep (transformers: the end ids + 1): each warper keeps 3.
HF_MIN_KEEP_PAIRS = [
    (processors.top_k(1, 3), hf.TopKLogitsWarper(1, min_tokens_to_keep=3)),
    (processors.top_p(0.05, 3), hf.TopPLogitsWarper(0.05, min_tokens_to_keep=3)),
    (processors.min_p(0.9, 3), hf.MinPLogitsWarper(0.9, min_tokens_to_keep=3)),
    (processors.typical_p(0.05, 3), hf.TypicalLogitsWarper(0.05, min_tokens_to_keep=3)),
    (processors.epsilon_cutoff(0.2, 3), hf.EpsilonLogitsWarper(0.2, min_tokens_to_keep=3)),
    (processors.eta_cutoff(0.2, 3), hf.EtaLogitsWarper(0.2, min_tokens_to_keep=3)),
]


@pytest.mark.parametrize("ours,theirs", HF_PAIRS + HF_MIN_KEEP_PAIRS,
                         ids=lambda p: getattr(p, "__name__", ""))
def test_each_processor_matches_transformers(ours, theirs):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=gen) * 3
    logits[2, :4] = logits[2].max() + torch.tensor([1.0, 0.0, 0.0, 0.0])  # a tie below the top
    ids = torch.randint(0, 64, (3, 12), generator=gen)
    ids[:, 3] = ids[:, 7]  # make repeated bigrams likely
    ids[:, 4] = ids[:, 8]
    torch.testing.assert_close(ours(ids, logits), theirs(ids, logits.clone()))


def test_full_chain_matches_transformers_order():
    settings = resolve_settings({"temperature": 0.8, "top_k": 30, "top_p": 0.9, "min_p": 0.05,
                                 "repetition_penalty": 1.2, "no_repeat_ngram_size": 3})
    chain = processors.build_processors(settings)
    reference = hf.LogitsProcessorList([
        hf.RepetitionPenaltyLogitsProcessor(1.2), hf.NoRepeatNGramLogitsProcessor(3),
        hf.TemperatureLogitsWarper(0.8), hf.TopKLogitsWarper(30), hf.TopPLogitsWarper(0.9),
        hf.MinPLogitsWarper(0.05)])
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 100, generator=gen) * 2
    ids = torch.randint(0, 100, (2, 20), generator=gen)
    torch.testing.assert_close(processors.apply(chain, ids, logits),
                               reference(ids, logits.clone()))


def test_greedy_chain_skips_sampling_processors():
    settings = resolve_settings({"strategy": "greedy", "temperature": 0.5, "top_k": 3})
    assert processors.build_processors(settings) == []
    assert settings.unused == ("temperature", "top_k")


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


@pytest.mark.parametrize("flags", [{"temperature": 0.7}, {"top_k": 8}, {"top_p": 0.8},
                                   {"min_p": 0.05, "temperature": 1.3},
                                   {"top_n_sigma": 1.0, "temperature": 1.3},
                                   {"epsilon_cutoff": 0.01, "eta_cutoff": 0.02},
                                   {"xtc_probability": 1.0, "xtc_threshold": 0.05,
                                    "mirostat": 2, "mirostat_tau": 4.0},
                                   {"presence_penalty": 1.0, "dry_multiplier": 0.8,
                                    "logit_bias": ["5=2"], "temperature": 1.0}])
def test_sampled_first_tokens_follow_processed_distribution(stories, flags):
    """2000 seeded rows through the real loop; the histogram of their first token is
    within total-variation 0.06 of the processed distribution (expected TV for this
    many samples is ~0.02; a wrong processor or sampler is off by far more)."""
    rows = 2000
    settings = resolve_settings({**flags, "max_new_tokens": 1, "seed": 123})
    ids = stories.encode("Once upon a time, there was a")
    finishes = generate.generate(stories, [ids] * rows, settings,
                               seeds=[config.derive_seed(123, i) for i in range(rows)])
    counts = torch.bincount(torch.tensor([f.token_ids[0] for f in finishes]),
                            minlength=stories.vocab_size).float()
    with torch.no_grad():
        logits = stories.model(torch.tensor([ids])).logits[:, -1].float()
    chain = processors.build_processors(settings, prompt_width=len(ids),
                                        tokenizer=stories.tokenizer)
    expected = processors.apply(chain, torch.tensor([ids]), logits).softmax(-1)[0]
    assert counts[expected == 0].sum() == 0  # never a filtered token
    tv = total_variation(counts / rows, expected)
    assert tv < 0.06, tv
    entropy = -(expected[expected > 0] * expected[expected > 0].log()).sum().item()
    assert entropy > math.log(2)  # the test is not trivially a near-deterministic choice


def test_chain_is_named_stages_in_documented_order():
    settings = resolve_settings({"temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                 "repetition_penalty": 1.2})
    chain = processors.build_processors(settings)
    assert [s.name for s in chain] == ["penalties", "temperature", "top_k", "top_p"]
    assert all(s.name in processors.STAGE_NAMES for s in chain)
    greedy = processors.build_processors(resolve_settings({"repetition_penalty": 1.2}))
    assert [s.name for s in greedy] == ["penalties"]  # sampling stages skipped


@pytest.mark.parametrize("token", [-1, 512, 10**6])
def test_a_bias_id_outside_the_vocabulary_is_refused(token: int):
    """A negative id would bias a token counted from the end; one past the vocabulary
    indexes no logit."""
    settings = resolve_settings({"logit_bias": {token: 2.0}})
    with pytest.raises(ConfigError, match=f"logit_bias token id {token} is outside the "
                                          r"model's vocabulary \(0-511\)"):
        processors.build_processors(settings, vocab_size=512)
    with pytest.raises(ConfigError, match="outside"):
        processors.check_for_model(settings, None, 512)
    assert processors.build_processors(resolve_settings({"logit_bias": {511: 2.0}}),
                                       vocab_size=512)


def test_a_bias_text_that_encodes_past_the_vocabulary_is_refused():
    """A tokenizer's added tokens may lie past the model's logits."""
    class AddedTokens:
        def encode(self, text, add_special_tokens=False):
            return [600]

    settings = resolve_settings({"logit_bias": {"<extra>": 2.0}})
    with pytest.raises(ConfigError, match="token id 600 is outside"):
        processors.check_for_model(settings, AddedTokens(), 512)


def test_beam_sampling_keeps_as_many_tokens_as_transformers(stories):
    """transformers' beam sampling builds its warpers with min_tokens_to_keep = the end
    ids + 1 (at least 2), so a beam always has a continuation that does not end; plain
    sampling keeps 1. stories260K has two end ids: top-p 0.01 on a peaked row keeps 1
    token when sampling, 3 with beams."""
    from genlib.decoding import beam

    assert len(stories.eos_ids) == 2
    peaked = probs([0.96, 0.02, 0.012, 0.008])
    for strategy, kept_count in (("sample", 1), ("beam", 3)):
        theirs = hf.TopPLogitsWarper(0.01, min_tokens_to_keep=kept_count)(None, peaked.clone())
        flags = {"top_p": 0.01, "do_sample": True, "strategy": strategy, "seed": 0}
        if strategy == "beam":
            flags["num_beams"] = 2
            chain = beam._make_plan(stories, resolve_settings(flags), False, 1).chain
        else:
            chain = make_plan(stories, resolve_settings(flags), 1).chain
        [stage] = [st for st in chain if st.name == "top_p"]
        assert sum(kept(stage(None, peaked))) == kept_count
        torch.testing.assert_close(stage(None, peaked), theirs)
