"""The samplers from other tools, each on hand-built logits against its reference:
transformers' processors for sequence bias and epsilon/eta cutoff, llama.cpp's own test
vectors (tests/test-sampling.cpp) and formulas (src/llama-sampling.cpp) for DRY, XTC,
top-nσ, penalties and Mirostat; distribution tests where they sample; the stage chain's
order and the settings that build it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import logits_process as hf

from genlib.errors import ConfigError
from genlib.sampling import draws as sampling
from genlib.sampling import processors
from genlib.settings.config import resolve_settings


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def probs_after(fn, probs: list[float], ids: list[int] | None = None) -> list[float]:
    token_ids = torch.tensor([ids if ids is not None else [0]])
    return fn(token_ids, logits_of(probs)).softmax(-1)[0].tolist()


def kept(out: torch.Tensor) -> list[bool]:
    return torch.isfinite(out[0]).tolist()


# --- penalties ----------------------------------------------------------------------

def test_logit_bias_matches_transformers_sequence_bias():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 32, generator=gen)
    ids = torch.randint(0, 32, (3, 8), generator=gen)
    ids[0, -2:] = torch.tensor([4, 5])  # row 0 ends with the prefix (4, 5) of (4, 5, 9)
    biases = {(3,): 2.5, (7,): -100.0, (4, 5, 9): 4.0, (11, 12): -1.0}
    ours = processors.logit_bias(biases)(ids, logits)
    theirs = hf.SequenceBiasLogitsProcessor([[list(k), v] for k, v in biases.items()])(
        ids, logits.clone())
    torch.testing.assert_close(ours, theirs)
    assert ours[0, 9] == logits[0, 9] + 4.0  # the prefix matched, so it counted


@pytest.mark.parametrize("context,expected", [  # llama.cpp test_penalties, freq 5, presence 5
    ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997]),
    ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966]),
    ([0, 1, 2, 0, 0], [0.000000, 0.000023, 0.000023, 0.499977, 0.499977]),
])
def test_presence_frequency_match_llama_cpp_vectors(context, expected):
    fn = processors.presence_frequency(5.0, 5.0, prompt_width=0)
    assert probs_after(fn, [0.2] * 5, context) == pytest.approx(expected, abs=1e-6)


def test_presence_frequency_count_generated_tokens_only():
    """OpenAI/vLLM: the prompt does not count; padding (-1) never counts."""
    ids = torch.tensor([[-1, 3, 3, 1, 1, 1]])  # prompt width 3 (a pad and two 3s)
    out = processors.presence_frequency(0.5, 0.25, prompt_width=3)(ids, torch.zeros(1, 5))
    assert out[0].tolist() == [0.0, -(0.5 + 3 * 0.25), 0.0, 0.0, 0.0]


def test_penalties_stage_runs_repetition_then_presence_frequency():
    settings = resolve_settings({"repetition_penalty": 2.0, "presence_penalty": 1.0})
    [stage] = processors.build_processors(settings, prompt_width=1)
    out = stage(torch.tensor([[0, 1]]), torch.tensor([[2.0, 2.0, 2.0]]))
    # token 0 (prompt): 2/2 = 1; token 1 (generated): 2/2 - 1 = 0
    assert stage.name == "penalties" and out[0].tolist() == [1.0, 0.0, 2.0]


@pytest.mark.parametrize("probs,context,expected,mult,base,allowed,last_n,breakers", [
    # llama.cpp tests/test-sampling.cpp test_dry, token-id breakers
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, set()),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5,
     set()),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, {3}),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1,
     2, 5, set()),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, set()),
])
def test_dry_matches_llama_cpp_vectors(probs, context, expected, mult, base, allowed, last_n,
                                       breakers):
    fn = processors.dry(mult, base, allowed, frozenset(breakers), last_n)
    assert probs_after(fn, probs, context) == pytest.approx(expected, abs=1e-6)


def test_dry_grows_with_repeat_length_and_stops_at_breakers():
    """llama.cpp's worked example: context a b c c b c y a b c; with allowed length 1 the
    next c extends a repeat of 3 (a b c), y one of 2 (b c), b one of 1 (c)."""
    a, b, c, y = 0, 1, 2, 3
    context = torch.tensor([[a, b, c, c, b, c, y, a, b, c]])
    out = processors.dry(1.0, 2.0, 1, frozenset(), -1)(context, torch.zeros(1, 5))
    assert out[0].tolist() == [0.0, -1.0, -4.0, -2.0, 0.0]  # 2**(n - 1) for n = 1, 3, 2
    # y as a breaker: no repeat runs across it, and y itself is never penalized
    out = processors.dry(1.0, 2.0, 1, frozenset({y}), -1)(context, torch.zeros(1, 5))
    assert out[0].tolist() == [0.0, -1.0, -4.0, 0.0, 0.0]
    # only the last 4 tokens scanned (y a b c): no earlier repeat of c
    out = processors.dry(1.0, 2.0, 1, frozenset(), 4)(context, torch.zeros(1, 5))
    assert out[0].tolist() == [0.0] * 5


@pytest.mark.parametrize("last_n", [10, 12, 15, 19, 20, 64])
def test_dry_window_longer_than_the_context_scans_all_of_it(last_n):
    """llama.cpp scans min(context, last_n) tokens: a window past the context's length
    (10 here) gives the whole-context penalties of the worked example above."""
    a, b, c, y = 0, 1, 2, 3
    context = torch.tensor([[a, b, c, c, b, c, y, a, b, c]])
    out = processors.dry(1.0, 2.0, 1, frozenset(), last_n)(context, torch.zeros(1, 5))
    assert out[0].tolist() == [0.0, -1.0, -4.0, -2.0, 0.0]


# --- truncation ---------------------------------------------------------------------

@pytest.mark.parametrize("threshold,expected", [  # llama.cpp test_xtc
    (0.09, [False, False, False, True]),
    (0.19, [False, False, True, True]),
    (0.29, [False, True, True, True]),
    (0.39, [True, True, True, True]),  # only one token reaches it: nothing removed
])
def test_xtc_matches_llama_cpp_vectors(threshold, expected):
    out = processors.xtc(threshold, 1.0, seed=0)(torch.tensor([[5]]),
                                                 logits_of([0.4, 0.3, 0.2, 0.1]))
    assert kept(out) == expected


def test_xtc_takes_only_the_candidates_earlier_stages_left():
    """llama.cpp's XTC sees the array top-k shrank: with threshold 0 every candidate
    qualifies and the least probable of them stays. Tokens already removed do not count
    (they once left no token at all, and sampling failed)."""
    logits = logits_of([0.3, 0.25, 0.2, 0.15, 0.1])
    out = processors.xtc(0.0, 1.0, seed=0)(torch.tensor([[5]]), processors.top_k(3)(None, logits))
    assert kept(out) == [False, False, True, False, False]


def test_xtc_keeps_one_of_tokens_tied_at_the_least_probability():
    """llama.cpp removes the first pos_last tokens of its sorted array, so exactly one of
    the tied least probable survives (which one is its sort's; here the lowest id)."""
    out = processors.xtc(0.2, 1.0, seed=0)(torch.tensor([[5]]),
                                           logits_of([0.4, 0.25, 0.25, 0.1]))
    assert kept(out) == [False, True, False, True]


def test_xtc_fires_with_its_probability():
    """Each context draws its own chance: over 4000 contexts, p = 0.3 removes the top
    choices in 30% of them (binomial sd 0.7%)."""
    contexts = torch.arange(4000)[:, None]
    logits = logits_of([0.5, 0.3, 0.2]).expand(4000, 3)
    out = processors.xtc(0.25, 0.3, seed=7)(contexts, logits)
    fired = torch.isinf(out[:, 0]).float().mean().item()
    assert abs(fired - 0.3) < 0.03
    again = processors.xtc(0.25, 0.3, seed=7)(contexts, logits)
    assert torch.equal(out, again)  # pure: the same context and seed, the same choice


@pytest.mark.parametrize("n,expected", [  # llama.cpp test_top_n_sigma
    (1.0, [0.0, 0.0, 0.428571, 0.571429]),
    (3.0, [0.1, 0.2, 0.3, 0.4]),
])
def test_top_n_sigma_matches_llama_cpp_vectors(n, expected):
    fn = processors.top_n_sigma(n)
    assert probs_after(fn, [0.1, 0.2, 0.3, 0.4]) == pytest.approx(expected, abs=1e-6)


def test_top_n_sigma_ignores_already_removed_tokens():
    logits = torch.tensor([[float("-inf"), 0.0, 1.0, 2.0]])
    # finite logits 0, 1, 2: mean 1, std sqrt(2/3) = 0.816; max - 1 * std = 1.18
    assert kept(processors.top_n_sigma(1.0)(None, logits)) == [False, False, False, True]


@pytest.mark.parametrize("ours,theirs", [
    (processors.epsilon_cutoff(0.02), hf.EpsilonLogitsWarper(0.02)),
    (processors.epsilon_cutoff(0.3), hf.EpsilonLogitsWarper(0.3)),
    (processors.eta_cutoff(0.02), hf.EtaLogitsWarper(0.02)),
    (processors.eta_cutoff(0.2), hf.EtaLogitsWarper(0.2)),
], ids=["eps.02", "eps.3", "eta.02", "eta.2"])
def test_epsilon_and_eta_match_transformers(ours, theirs):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=gen) * 2
    logits[3, 5] = float("-inf")
    torch.testing.assert_close(ours(None, logits), theirs(None, logits.clone()))


def test_mirostat_truncates_by_surprise_and_adapts_mu():
    """mu starts at 2 * tau bits; tokens with -log2 p > mu go; after a draw,
    mu <- mu - eta * (surprise - tau), the surprise measured where it was drawn."""
    state = processors.MirostatState(tau=1.0, eta=0.5)
    fn = processors.mirostat_v2(state)
    out = fn(None, logits_of([0.5, 0.3, 0.15, 0.05]))  # mu = 2: keeps p >= 0.25
    assert kept(out) == [True, True, False, False]
    state.observe(out, torch.tensor([1]))  # p = 0.3 / 0.8 after truncation
    surprise = -math.log2(0.3 / 0.8)
    assert state.mu.tolist() == pytest.approx([2.0 - 0.5 * (surprise - 1.0)])
    assert kept(fn(None, logits_of([0.5, 0.3, 0.15, 0.05]))) == [True, True, False, False]
    state.reorder(torch.tensor([0, 0]))  # rows follow the batch
    assert state.mu.shape == (2,)


def test_mirostat_keeps_one_token_when_none_is_within_mu():
    """llama.cpp's `size = 1`: uniform over 8 tokens, each 3 bits of surprise, mu 2 bits
    (tau 1): the first token alone stays, not all eight tied at the top."""
    fn = processors.mirostat_v2(processors.MirostatState(tau=1.0, eta=0.1))
    assert kept(fn(None, torch.zeros(1, 8))) == [True] + [False] * 7


def test_mirostat_holds_average_surprise_near_tau():
    """The controller's purpose: on a Zipf distribution over 200 tokens (entropy ~5.3
    bits), sampling with tau = 3 keeps the observed surprise near 3 bits on average."""
    ranks = torch.arange(1, 201, dtype=torch.float)
    logits = (1.0 / ranks).log()[None]
    state = processors.MirostatState(tau=3.0, eta=0.1)
    fn = processors.mirostat_v2(state)
    gen = torch.Generator().manual_seed(0)
    surprises = []
    for _ in range(3000):
        out = fn(None, logits)
        token = torch.multinomial(out.softmax(-1), 1, generator=gen)[:, 0]
        surprises.append(-out.log_softmax(-1)[0, token].item() / math.log(2))
        state.observe(out, token)
    average = sum(surprises[500:]) / len(surprises[500:])
    assert abs(average - 3.0) < 0.15, average


def test_mirostat_takes_a_target_beyond_float32_as_cutting_nothing():
    """tau = 1e300 is a finite setting: mu = 2 * tau rounds to inf in float32, as
    llama.cpp's `float mu` does, and nothing is cut (torch.full used to raise)."""
    fn = processors.mirostat_v2(processors.MirostatState(tau=1e300, eta=0.1))
    assert kept(fn(None, logits_of([0.9, 0.09, 0.01]))) == [True, True, True]


# --- the chain ----------------------------------------------------------------------

def test_default_order_puts_every_stage_in_place():
    settings = resolve_settings({
        "logit_bias": ["3=1"], "presence_penalty": 0.5, "no_repeat_ngram_size": 3,
        "dry_multiplier": 0.8, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
        "typical_p": 0.99, "epsilon_cutoff": 0.0001, "eta_cutoff": 0.0001,
        "top_n_sigma": 2.0, "xtc_probability": 0.5, "mirostat": 2})
    names = [s.name for s in processors.build_processors(settings)]
    assert names == list(processors.DEFAULT_ORDER)


def test_samplers_sets_the_order_and_accepts_llama_cpp_names():
    settings = resolve_settings({"samplers": "top_k;typ_p;temp", "top_k": 5,
                                 "typical_p": 0.9, "temperature": 0.5})
    assert settings.samplers == ("top_k", "typical_p", "temperature")
    assert [s.name for s in processors.build_processors(settings)] == \
        ["top_k", "typical_p", "temperature"]


def test_samplers_order_changes_the_result():
    """temperature before min-p sees the sharpened distribution: a different kept set."""
    logits = logits_of([0.5, 0.3, 0.2])
    results = []
    for order in ("temperature;min_p", "min_p;temperature"):
        s = resolve_settings({"samplers": order, "temperature": 0.25, "min_p": 0.3})
        results.append(kept(processors.apply(processors.build_processors(s), None, logits)))
    # temp 0.25 first: p ∝ p^4 -> 0.84, 0.11, 0.02: 0.3 * 0.84 drops two of them
    assert results == [[True, False, False], [True, True, True]]


@pytest.mark.parametrize("flags,message", [
    ({"samplers": "top_k;bogus"}, "no stage 'bogus'"),
    ({"samplers": "top_k;top_k"}, "twice"),
    ({"samplers": "top_k", "top_p": 0.9}, "leaves out top_p"),
    ({"mirostat": 1}, "0 or 2"),
    ({"xtc_threshold": 0.6}, "0.5"),
    ({"presence_penalty": 3.0}, "-2 <= presence_penalty <= 2"),
    ({"dry_base": 0.5}, ">= 1"),
    ({"logit_bias": ["x=abc"]}, "must be a number"),
    ({"logit_bias": ["noequals"]}, "TOKEN=BIAS"),
    ({"mirostat": 2, "strategy": "beam"}, "beam"),
    ({"json_schema": '{"type": "object"', "max_new_tokens": 5}, "not valid JSON"),
    ({"json_schema": {"type": "nonsense"}}, "not a valid JSON schema"),
    ({"regex": "a+", "grammar": "root ::= \"a\""}, "one of json_schema, regex, grammar"),
    ({"regex": "a+", "ignore_eos": True}, "ignore_eos"),
])
def test_settings_are_validated_where_built(flags, message):
    with pytest.raises(ConfigError, match=message):
        resolve_settings(flags)


def test_new_keys_imply_sampling_and_round_trip():
    s = resolve_settings({"top_n_sigma": 1.0, "logit_bias": {"hello": 2, 42: -5}})
    assert s.strategy == "sample"
    assert s.logit_bias == (("hello", 2.0), (42, -5.0))
    assert s.replace(seed=1).logit_bias == s.logit_bias  # through to_dict and back


def test_logit_bias_text_is_encoded_with_the_tokenizer(stories_tokenizer):
    s = resolve_settings({"logit_bias": [" dog=3", "7=-1"]})
    [stage] = processors.build_processors(s, tokenizer=stories_tokenizer)
    dog = stories_tokenizer.encode(" dog", add_special_tokens=False)
    out = stage(torch.tensor([[dog[0]] if len(dog) > 1 else [1]]), torch.zeros(1, 512))
    assert out[0, dog[-1]] == 3.0 and out[0, 7] == -1.0


def test_new_keys_load_from_a_yaml_preset(tmp_path, stories_tokenizer):
    from genlib.settings.presets import load_preset

    path = tmp_path / "mine.yaml"
    path.write_text(
        "extends: llamacpp\n"
        "dry_multiplier: 0.8\n"
        "dry_sequence_breakers: [\"\\n\", ':']\n"
        "logit_bias: {' the': -2, 13: 1.5}\n"
        "xtc_probability: 0.5\n"
        "json_schema: {type: object, properties: {a: {type: integer}}}\n")
    settings = resolve_settings(None, load_preset(str(path)).settings)
    assert settings.samplers[-1] == "temperature" and settings.dry_multiplier == 0.8
    assert settings.logit_bias == ((" the", -2.0), (13, 1.5))
    assert settings.dry_sequence_breakers == ("\n", ":")
    assert '"a":{"type":"integer"}' in settings.json_schema
    chain = processors.build_processors(settings, tokenizer=stories_tokenizer)
    names = [s.name for s in chain]
    assert names == ["logit_bias", "dry", "top_k", "top_p", "min_p", "xtc", "temperature"]


# --- the CLI ------------------------------------------------------------------------

NEW_FLAGS = ["--logit-bias", "--presence-penalty", "--frequency-penalty", "--dry-multiplier",
             "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
             "--dry-sequence-breaker", "--xtc-probability", "--xtc-threshold",
             "--top-n-sigma", "--epsilon-cutoff", "--eta-cutoff", "--mirostat",
             "--mirostat-tau", "--mirostat-eta", "--samplers", "--json-schema", "--regex",
             "--grammar"]


@pytest.mark.parametrize("command", ["generate", "beam", "speculate"])
def test_every_new_flag_is_offered_with_its_tool_named(command):
    import re

    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
    for flag in NEW_FLAGS:
        assert flag in text, flag
    for tool in ("(llama.cpp)", "(OpenAI, vLLM)", "(transformers)", "xgrammar"):
        assert tool in text, tool


def test_cli_flags_reach_the_settings_and_the_output(stories_tokenizer):
    import json

    from typer.testing import CliRunner

    from cli.main import app
    from tests.conftest import STORIES

    runner = CliRunner()
    comma = stories_tokenizer.encode(",", add_special_tokens=False)[-1]  # what comes next
    args = ["generate", "Once upon a time", "-m", str(STORIES), "-n", "12", "--seed", "5",
            "--json", "--logit-bias", f"{comma}=-100", "--logit-bias", " girl=2",
            "--presence-penalty", "0.5", "--dry-multiplier", "0.8", "--dry-sequence-breaker",
            "\\n", "--xtc-probability", "0.5", "--top-n-sigma", "2", "--mirostat", "2",
            "--samplers", "logit_bias;penalties;dry;top_n_sigma;xtc;mirostat;temperature"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    record = document["outputs"][0]  # the JSON contract (docs/output.md)
    s = document["settings"]
    assert s["strategy"] == "sample" and s["mirostat"] == 2 and s["top_n_sigma"] == 2.0
    assert s["logit_bias"] == {str(comma): -100.0, " girl": 2.0}
    assert s["dry_sequence_breakers"] == ["\n"]
    assert s["samplers"][-1] == "temperature"
    assert comma not in record["token_ids"]  # banned by its bias
    again = runner.invoke(app, args)
    assert json.loads(again.stdout)["outputs"][0]["token_ids"] == record["token_ids"]  # seeded
    bad = runner.invoke(app, ["generate", "x", "-m", str(STORIES), "--mirostat", "1"])
    assert bad.exit_code == 2 and "mirostat must be 0 or 2" in bad.stderr


# --- settings that overflow float32 ---------------------------------------------------

@pytest.mark.parametrize("flags", [
    ["-t", "1e-40"],                                 # logits / 1e-40: inf
    ["-t", "1e39", "--min-new-tokens", "4"],         # 1e39 is inf in float32: -inf / inf
    ["-t", "0.8", "--repetition-penalty", "1e-40"],  # a repeated token's logit: inf
    ["-t", "0.8", "--logit-bias", "5=3e38"],         # logit + 3e38: inf
])
@pytest.mark.parametrize("command", [["generate"], ["beam", "-k", "2", "--sample"],
                                     ["speculate", "--prompt-lookup", "2"], ["explain"]])
def test_settings_past_float32_s_range_are_one_line_not_a_crash(command, flags):
    """Each ended 'unexpected RuntimeError: probability tensor contains either inf, nan
    or element < 0', exit 1 (transformers' generate() fails the same way)."""
    from typer.testing import CliRunner
    if command[0] == "beam" and "--repetition-penalty" in flags:
        # beam search penalises logprobs, as transformers does: a negative number times
        # 1e-40 is near 0, a repeated token's probability near 1, and nothing overflows
        pytest.skip("no overflow in beam search")

    from cli.main import app
    from tests.conftest import STORIES

    result = CliRunner().invoke(app, [*command, "Once upon a time", "-m", str(STORIES),
                                      "--seed", "1", "-n", "6", *flags])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: {sampling.OVERFLOW}"]


def test_draws_refuse_weights_that_are_not_numbers():
    nan = torch.tensor([0.5, float("nan"), 0.5])
    for call in (lambda: sampling.draw(nan), lambda: sampling.multinomial(nan.log()),
                 lambda: sampling.inverse_cdf(nan.log())):
        with pytest.raises(ConfigError, match="past float32's range"):
            call()


def test_token_texts_go_with_their_tokenizer():
    """The decoded texts are held per tokenizer object, not per id(): once a tokenizer is
    freed its entry goes, so one created later at the same address never reads them."""
    import gc

    from genlib.sampling import processors

    class Vocab:
        def __init__(self, word: str) -> None:
            self.word = word

        def __len__(self) -> int:
            return 2

        def decode(self, ids: list[int]) -> str:
            return f"{self.word}{ids[0]}"

    first = Vocab("a")
    assert processors._token_texts(first) == ["a0", "a1"]
    del first
    gc.collect()
    assert len(processors._TEXTS) == 0 or all(
        texts != ["a0", "a1"] for texts in processors._TEXTS.values())
    assert processors._token_texts(Vocab("b")) == ["b0", "b1"]
