"""Contrastive search (Su et al., 2022) against a reference written here from the
paper's formula over transformers' own forward (`output_hidden_states=True`, the whole
sequence recomputed for every candidate of every step): token for token, on a small
random Llama and on stories260K; and its refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from genlib.generate import generate
from genlib.settings.config import resolve_settings
from tests.conftest import ROOT, STORIES

STEPS = 32


def reference_contrastive(model, prompt: list[int], alpha: float, k: int, steps: int,
                          eos: tuple[int, ...]) -> list[int]:
    """x_t = argmax over the top-k v of (1 - alpha) * p(v | x_<t) - alpha * max_j
    cos(h_v, h_j), h the last layer's hidden states (after the final norm)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            out = model(torch.tensor([ids]), output_hidden_states=True)
            probs = out.logits[0, -1].float().softmax(-1)
            context = out.hidden_states[-1][0]
            top_probs, top_ids = probs.topk(k)
            scores = []
            for p, v in zip(top_probs.tolist(), top_ids.tolist()):
                longer = model(torch.tensor([ids + [v]]), output_hidden_states=True)
                h = longer.hidden_states[-1][0, -1]
                similarity = F.cosine_similarity(h[None], context, dim=-1).max().item()
                scores.append((1 - alpha) * p - alpha * similarity)
            ids.append(top_ids[scores.index(max(scores))].item())
            if ids[-1] in eos:
                break
    return ids[len(prompt):]


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def genlab_tokens(lm, prompt: list[int], **settings) -> list[int]:
    chosen = resolve_settings({"max_new_tokens": STEPS, **settings})
    return list(generate(lm, [prompt], chosen)[0].token_ids)


@pytest.fixture(scope="module")
def random_llama(stories_tokenizer):
    """A random Llama of 4 layers, untied head, grouped-query attention; init scaled so
    its tokens vary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from genlib.models.loading import wrap_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.08,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return wrap_model(LlamaForCausalLM(config), stories_tokenizer, ref="random-llama")


@pytest.mark.parametrize("alpha,k", [(0.6, 4), (0.3, 6)])
def test_matches_the_reference_on_a_random_llama(random_llama, alpha, k):
    prompt = [1, 45, 300, 7, 99, 12]
    expected = reference_contrastive(random_llama.model, prompt, alpha, k, STEPS,
                                     random_llama.eos_ids)
    assert len(set(expected)) > 8  # the tokens vary
    assert expected != reference_greedy(random_llama.model, prompt, len(expected))
    assert genlab_tokens(random_llama, prompt, penalty_alpha=alpha, top_k=k) == expected


def test_matches_the_reference_on_stories(stories):
    prompt = stories.encode("Once upon a time")
    expected = reference_contrastive(stories.model, prompt, 0.6, 4, STEPS, stories.eos_ids)
    assert len(expected) == STEPS
    assert expected != reference_greedy(stories.model, prompt, STEPS)
    assert genlab_tokens(stories, prompt, penalty_alpha=0.6, top_k=4) == expected


def test_alpha_zero_is_greedy(stories):
    prompt = stories.encode("The dog")
    assert genlab_tokens(stories, prompt, penalty_alpha=0.0, top_k=4) == \
        reference_greedy(stories.model, prompt, STEPS)


def test_the_processors_run_before_the_candidates_are_taken(stories):
    """A banned token is never a candidate (processed distribution's top-k)."""
    prompt = stories.encode("Once upon a time")
    plain = genlab_tokens(stories, prompt, penalty_alpha=0.6, top_k=4)
    banned = genlab_tokens(stories, prompt, penalty_alpha=0.6, top_k=4,
                           logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "generate", "Once upon a time",
                           "-m", str(STORIES), "--max-new-tokens", "4", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_cli_runs_it_on_the_lean_forward():
    done = run_cli("--penalty-alpha", "0.6", "--top-k", "4", "--stats")
    assert done.returncode == 0, done.stderr
    assert " ".join(done.stderr.split()).count("backend lean (the lean forward, which gives "
                                                "hidden states; the native backend gives no "
                                                "hidden states, which contrastive search "
                                                "needs)") == 1


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (("--penalty-alpha", "0.6", "--top-k", "4", "--backend", "native"),
     "the native backend gives no hidden states, which contrastive search needs; use "
     "--backend lean"),
    (("--penalty-alpha", "1.5", "--top-k", "4"), "penalty_alpha must be 0 <= penalty_alpha <= 1"),
    (("--penalty-alpha", "0.6"), "penalty_alpha (contrastive search) needs top_k >= 2"),
    (("--penalty-alpha", "0.6", "--top-k", "4", "--strategy", "sample"),
     "not with strategy sample"),
    (("--penalty-alpha", "0.6", "--top-k", "4", "--quantize", "8bit"),
     "contrastive search needs the lean forward's hidden states"),
])
def test_refusals_are_one_line_and_exit_2(args, message):
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_presets_and_compare_put_both_beside_greedy(stories):
    """The built-in presets hold transformers' suggestions, and `compare` runs them as
    strategies with the usual metrics: their outputs are the methods' own tokens."""
    from genlib.lab.compare import build_strategies, compare

    strategies = build_strategies(["greedy", "contrastive", "dola"], [],
                                  {"max_new_tokens": 12})
    by_label = {s.label: s.settings for s in strategies}
    assert by_label["contrastive"].penalty_alpha == 0.6
    assert by_label["contrastive"].top_k == 4 and by_label["contrastive"].strategy == "greedy"
    assert by_label["dola"].dola_layers == "high"
    assert by_label["dola"].repetition_penalty == 1.2
    prompt = stories.encode("Once upon a time")
    results = compare(stories, prompt, strategies).results
    assert [r.error for r in results] == [None, None, None]
    assert all(r.metrics["distinct_2"] is not None for r in results)
    outputs = {r.strategy.label: list(r.samples[0].token_ids) for r in results}
    assert outputs["contrastive"] == genlab_tokens(stories, prompt, penalty_alpha=0.6,
                                                   top_k=4, max_new_tokens=12)
    assert outputs["dola"] == genlab_tokens(stories, prompt, dola_layers="high",
                                            repetition_penalty=1.2, max_new_tokens=12)
    assert outputs["contrastive"] != outputs["greedy"]
