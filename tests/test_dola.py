"""DoLa (Chuang et al., 2024) against a reference written here from the paper's
formulas over transformers' own forward (`output_hidden_states=True`, the whole sequence
recomputed each step; early exits as the reference code takes them: lm_head on layer
j's hidden state), token for token, on a small random Llama and on stories260K; the
candidate layers of `low` and `high`; and the refusals."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from genlib.decoding.dola import candidate_layers
from genlib.errors import ConfigError
from genlib.generate import generate
from genlib.settings.config import resolve_settings
from tests.conftest import ROOT, STORIES

STEPS = 32


def divergence(final_logits: torch.Tensor, early_logits: torch.Tensor) -> float:
    """The layer-choice divergence as DoLa's reference code (and transformers') computes
    its "JSD": (KL(m || q_N) + KL(m || q_j)) / 2, m = (q_N + q_j) / 2. (The textbook
    JSD takes KL(q || m); both are 0 for equal distributions and grow apart, but
    they can rank layers differently, and genlab follows the reference code.)"""
    log_final, log_early = final_logits.log_softmax(-1), early_logits.log_softmax(-1)
    m = 0.5 * (log_final.exp() + log_early.exp())

    def kl_from_m(log_q: torch.Tensor) -> torch.Tensor:
        return (torch.xlogy(m, m) - m * log_q).sum()

    return float(0.5 * (kl_from_m(log_final) + kl_from_m(log_early)))


def reference_dola(model, prompt: list[int], layers: tuple[int, ...], steps: int,
                   eos: tuple[int, ...], penalty: float = 1.0
                   ) -> tuple[list[int], list[int]]:
    """The tokens, and the premature layer of each step: M = argmax_j of the
    divergence of q_j from q_N (`divergence`);
    scores log q_N(x) - log q_M(x) where q_N(x) >= 0.1 max q_N, else -inf; then the
    repetition penalty (transformers' processor), then the argmax."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids, chosen = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            final = out.logits[0, -1].float()
            early = {j: model.lm_head(out.hidden_states[j][0, -1]).float() for j in layers}
            premature = max(layers, key=lambda j: divergence(final, early[j]))
            chosen.append(premature)
            q_final = final.softmax(-1)
            plausible = q_final >= 0.1 * q_final.max()
            scores = torch.where(plausible, q_final.log() - early[premature].log_softmax(-1),
                                 torch.tensor(-math.inf))
            if penalty != 1.0:
                scores = RepetitionPenaltyLogitsProcessor(penalty)(
                    torch.tensor([ids]), scores[None])[0]
            ids.append(int(scores.argmax()))
            if ids[-1] in eos:
                break
    return ids[len(prompt):], chosen


def genlab_tokens(lm, prompt: list[int], **settings) -> list[int]:
    chosen = resolve_settings({"max_new_tokens": STEPS, **settings})
    return list(generate(lm, [prompt], chosen)[0].token_ids)


@pytest.fixture(scope="module")
def random_llama(stories_tokenizer):
    """A random Llama of 6 layers, untied head; init scaled so its tokens vary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from genlib.models.loading import wrap_model

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return wrap_model(LlamaForCausalLM(config), stories_tokenizer, ref="random-llama")


@pytest.mark.parametrize("dola_layers,layers,penalty", [
    ("high", (3, 5), 1.0), ("0,2,4", (0, 2, 4), 1.2), ("low", (0, 2), 1.2)])
def test_matches_the_reference_on_a_random_llama(random_llama, dola_layers, layers, penalty):
    assert candidate_layers(dola_layers, 6, tied=False) == layers
    prompt = [1, 45, 300, 7, 99, 12]
    expected, chosen = reference_dola(random_llama.model, prompt, layers, STEPS,
                                      random_llama.eos_ids, penalty)
    assert len(set(expected)) > 8  # the tokens vary
    assert len(set(chosen)) > 1  # and so does the premature layer
    assert genlab_tokens(random_llama, prompt, dola_layers=dola_layers,
                         repetition_penalty=penalty) == expected


@pytest.mark.parametrize("prompt,dola_layers,varies", [
    ("Once upon a time", "high", False), ("Lily wanted to", "0,1,2,3,4", True)])
def test_matches_the_reference_on_stories(stories, prompt, dola_layers, varies):
    assert candidate_layers("high", 5, tied=True) == (2, 4)  # tied: from layer 2
    layers = candidate_layers(dola_layers, 5, tied=True)
    ids = stories.encode(prompt)
    expected, chosen = reference_dola(stories.model, ids, layers, STEPS, stories.eos_ids, 1.2)
    assert (len(set(chosen)) > 1) == varies
    # The last candidate held throughout gives other tokens: the choice decides them.
    assert reference_dola(stories.model, ids, layers[-1:], STEPS, stories.eos_ids,
                          1.2)[0] != expected
    assert genlab_tokens(stories, ids, dola_layers=dola_layers,
                         repetition_penalty=1.2) == expected


def test_contrast_keeps_the_plausible_tokens_alone():
    """Tokens with q_N < 0.1 * max q_N score -inf; the others log q_N - log q_M."""
    from genlib.decoding.dola import contrast

    final = torch.tensor([[0.5, 0.3, 0.04, 0.16]]).log()
    base = torch.tensor([[0.4, 0.05, 0.2, 0.35]]).log()
    scores = contrast(final, base)[0]
    assert torch.isinf(scores[2]) and scores[2] < 0  # 0.04 < 0.1 * 0.5
    expected = (torch.tensor([0.5, 0.3, 0.16]) / torch.tensor([0.4, 0.05, 0.35])).log()
    assert torch.allclose(scores[[0, 1, 3]], expected)
    assert int(scores.argmax()) == 1  # the contrast, not the final layer, decides


def test_bucket_definitions():
    """transformers' buckets: with N layers (N <= 40) low is range(start, N // 2, 2) and
    high range(N // 2, N, 2), start 0 (untied), 2 (tied, N > 2); past 40 layers, 20
    layers' worth at each end."""
    assert candidate_layers("low", 32, tied=False) == tuple(range(0, 16, 2))
    assert candidate_layers("high", 32, tied=True) == tuple(range(16, 32, 2))
    assert candidate_layers("low", 8, tied=True) == (2,)
    assert candidate_layers("low", 4, tied=True) == (2,)
    assert candidate_layers("low", 2, tied=True) == (1,)
    assert candidate_layers("low", 60, tied=True) == tuple(range(2, 20, 2))
    assert candidate_layers("high", 60, tied=True) == tuple(range(40, 60, 2))
    assert candidate_layers("3,1", 5, tied=True) == (3, 1)
    with pytest.raises(ConfigError, match="dola_layers 5 is past the model's premature"):
        candidate_layers("1,5", 5, tied=True)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "generate", "Once upon a time",
                           "-m", str(STORIES), "--max-new-tokens", "4", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (("--dola-layers", "high", "--backend", "native"),
     "the native backend gives no hidden states, which DoLa needs; use --backend lean"),
    (("--dola-layers", "high", "--quantize", "8bit"),
     "DoLa needs the lean forward's hidden states"),
    (("--dola-layers", "2,9"), "dola_layers 9 is past the model's premature layers: it has "
                               "5 layers"),
    (("--dola-layers", "middle"), "dola_layers must be low, high or layer numbers"),
    (("--dola-layers", "high", "--penalty-alpha", "0.6", "--top-k", "4"),
     "give one of penalty_alpha (contrastive search) and dola_layers (DoLa), not both"),
])
def test_refusals_are_one_line_and_exit_2(args, message):
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.slow
def test_beam_search_is_refused():
    done = subprocess.run([sys.executable, "-m", "cli", "beam", "Once upon a time", "-m",
                           str(STORIES), "--max-new-tokens", "4", "--dola-layers", "high"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "dola_layers (DoLa) runs greedy or sampling, not beam search" in done.stderr


def test_the_logprobs_table_names_the_scores_it_shows():
    """Under DoLa or combined models `logprob` is under the scores they made, and the
    --logprobs table's title says so rather than "raw model"."""
    from cli.render_tokens import logprobs_title

    assert logprobs_title(resolve_settings({})) == "logprobs (raw model / processed)"
    assert logprobs_title(resolve_settings({"dola_layers": "high"})) == \
        "logprobs (DoLa's scores / processed)"
    assert logprobs_title(resolve_settings({"ensemble_mode": "mean"})) == \
        "logprobs (the ensemble / processed)"
    assert logprobs_title(resolve_settings({"cd_beta": 0.5})) == \
        "logprobs (contrastive decoding's scores / processed)"


@pytest.mark.slow
def test_dolas_logprobs_table_says_whose_they_are():
    done = run_cli("-p", "dola", "--logprobs", "1")
    assert done.returncode == 0, done.stderr
    assert "logprobs (DoLa's scores / processed)" in done.stderr
    assert "raw model" not in done.stderr
