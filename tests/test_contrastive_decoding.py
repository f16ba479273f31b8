"""Contrastive decoding (genlib.sampling.combine.contrastive, `--amateur --cd-beta --cd-alpha`).

Its greedy tokens equal a reference computed here from the expert's and the amateur's
own transformers logits with the formula (1+beta) log p_e - beta log p_a over the
expert's alpha head; beta = 0 is the expert alone; the cutoff removes exactly the tokens
below alpha times the expert's top probability; beam search scores hypotheses by the
combined log-probabilities.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from genlib.decoding.beam import beam_search
from genlib.errors import ConfigError
from genlib.generate import generate
from genlib.sampling.combine import Partner, contrastive, plausible
from genlib.settings.config import GenerationSettings
from tests.conftest import CODE_DRAFT, CODE_TARGET, LLAMA2XS, ROOT, STORIES, shared_model

CODE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


@pytest.fixture(scope="module")
def code_draft():
    return shared_model(CODE_DRAFT)


def with_amateur(expert, amateur):
    return dataclasses.replace(expert, partners=(Partner(amateur, "amateur"),))


def logprobs_along(lm, ids: list[int]) -> torch.Tensor:
    """log p(next token | ids[:i+1]) at every position, from the transformers model."""
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def reference_scores(expert, amateur, ids: list[int], beta: float, alpha: float
                     ) -> torch.Tensor:
    """The paper's score at every position, written out here from the formula."""
    e, a = logprobs_along(expert, ids), logprobs_along(amateur, ids)
    head = e.exp() >= alpha * e.exp().max(-1, keepdim=True).values
    return torch.where(head, (1 + beta) * e - beta * a, torch.tensor(-math.inf))


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_beta_zero_gives_the_experts_greedy_tokens(code_target, code_draft, backend) -> None:
    ids = code_target.encode(CODE_PROMPT)
    expert = generate(code_target, [ids], GenerationSettings(max_new_tokens=32),
                      backend=backend)[0]
    cd = generate(with_amateur(code_target, code_draft), [ids],
                  GenerationSettings(max_new_tokens=32, cd_beta=0.0, cd_alpha=0.1),
                  backend=backend)[0]
    assert cd.token_ids == expert.token_ids


@pytest.mark.parametrize("backend", ["native", "transformers"])
@pytest.mark.parametrize(("pair", "beta", "alpha"), [
    ("code", 0.5, 0.1), ("code", 1.0, 0.0), ("stories", 0.5, 0.1)])
def test_greedy_tokens_follow_the_formula(code_target, code_draft, stories, llama2xs,
                                          backend, pair, beta, alpha) -> None:
    expert, amateur = (code_target, code_draft) if pair == "code" else (stories, llama2xs)
    ids = expert.encode(CODE_PROMPT if pair == "code" else "One day, a little bird")
    settings = GenerationSettings(max_new_tokens=24, cd_beta=beta, cd_alpha=alpha)
    out = generate(with_amateur(expert, amateur), [ids], settings, backend=backend)[0]
    scores = reference_scores(expert, amateur, ids + list(out.token_ids), beta, alpha)
    picks = [int(scores[len(ids) - 1 + step].argmax()) for step in range(len(out.token_ids))]
    assert list(out.token_ids) == picks
    alone = generate(expert, [ids], GenerationSettings(max_new_tokens=24))[0]
    assert alone.token_ids != out.token_ids  # the amateur changed the output


def test_the_cutoff_removes_exactly_the_tokens_below_alpha_times_the_top() -> None:
    expert = torch.tensor([[0.5, 0.2, 0.05, 0.049, 0.201, 0.0]]).log()  # sums to 1
    kept = plausible(expert, 0.1)  # the cutoff is 0.05: 0.05 stays, 0.049 goes
    assert kept.tolist() == [[True, True, True, False, True, False]]
    amateur = torch.full_like(expert, math.log(1 / 6))
    scores = contrastive(expert, amateur, 0.5, 0.1)
    assert torch.isinf(scores[0, [3, 5]]).all()
    assert torch.allclose(scores[0, [0, 1, 2, 4]],
                          1.5 * expert[0, [0, 1, 2, 4]] - 0.5 * amateur[0, [0, 1, 2, 4]])
    # alpha 0 keeps every token the expert gives p > 0; alpha 1 its top one alone
    assert plausible(expert, 0.0).sum() == 5 and plausible(expert, 1.0).sum() == 1


def test_the_amateur_can_outvote_the_experts_top_token() -> None:
    expert = torch.tensor([[0.6, 0.4]]).log()
    amateur = torch.tensor([[0.9, 0.1]]).log()
    assert int(contrastive(expert, amateur, 0.5, 0.1).argmax()) == 1
    assert int(contrastive(expert, amateur, 0.0, 0.1).argmax()) == 0


def test_beam_search_scores_by_the_combined_logprobs(code_target, code_draft) -> None:
    ids = code_target.encode(CODE_PROMPT)
    settings = GenerationSettings(strategy="beam", num_beams=3, max_new_tokens=12,
                                  cd_beta=0.5, cd_alpha=0.1)
    best = beam_search(with_amateur(code_target, code_draft), [ids], settings)[0].hypotheses[0]
    scores = reference_scores(code_target, code_draft, ids + list(best.token_ids), 0.5, 0.1)
    combined = scores.log_softmax(-1)
    expected = sum(float(combined[len(ids) - 1 + i, t]) for i, t in enumerate(best.token_ids))
    assert best.sum_logprob == pytest.approx(expected, abs=1e-3)
    assert best.score == pytest.approx(expected / len(best.token_ids), abs=1e-4)
    plain = beam_search(code_target, [ids], dataclasses.replace(settings, cd_beta=None))[0]
    assert plain.hypotheses[0].token_ids != best.token_ids


def test_sampling_draws_from_the_combined_distribution_reproducibly(stories, llama2xs) -> None:
    ids = stories.encode("Once upon a time")
    settings = GenerationSettings(strategy="sample", max_new_tokens=16, seed=3, cd_beta=0.5,
                                  top_k=20)
    lm = with_amateur(stories, llama2xs)
    first, again = (generate(lm, [ids], settings)[0] for _ in range(2))
    assert first.token_ids == again.token_ids
    scores = reference_scores(stories, llama2xs, ids + list(first.token_ids), 0.5, 0.1)
    for step, token in enumerate(first.token_ids):  # never outside the expert's head
        assert scores[len(ids) - 1 + step, token] > -math.inf


def test_cd_settings_without_an_amateur_are_refused(stories) -> None:
    with pytest.raises(ConfigError, match="give --amateur MODEL"):
        generate(stories, [stories.encode("Once")],
                 GenerationSettings(max_new_tokens=2, cd_beta=0.5))


# ---------------------------------------------------------------- the command line

def genlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cli_cd_with_beta_zero_prints_the_experts_text() -> None:
    alone = genlab("generate", "Once upon a time", "-m", str(STORIES), "-n", "16")
    cd = genlab("generate", "Once upon a time", "-m", str(STORIES), "-n", "16",
                "--amateur", str(LLAMA2XS), "--cd-beta", "0", "--json")
    assert alone.returncode == cd.returncode == 0, cd.stderr
    import json

    doc = json.loads(cd.stdout)
    assert doc["outputs"][0]["text"] + "\n" == alone.stdout
    assert doc["settings"]["cd_beta"] == 0.0 and doc["settings"]["cd_alpha"] == 0.1
    assert "contrastive decoding (beta 0, alpha 0.1)" in doc["backend"]["reason"]


@pytest.mark.parametrize(("args", "message"), [
    (["--cd-beta", "0.5"], "--cd-beta needs --amateur MODEL"),
    (["--cd-alpha", "0.2"], "--cd-alpha needs --amateur MODEL"),
    (["--amateur", str(LLAMA2XS), "--cd-beta", "-0.5"], "cd_beta must be 0 <= cd_beta <= 1e6"),
    (["--amateur", str(LLAMA2XS), "--cd-beta", "1e39"], "got 1e+39"),  # past float32: crashed
    (["--amateur", str(LLAMA2XS), "--cd-alpha", "1.5"], "0 <= cd_alpha <= 1"),
    (["--amateur", str(CODE_TARGET)], "first at token id 0"),
    (["-p", "cd"], "give --amateur MODEL"),
])
def test_cli_bad_cd_input_is_one_line_and_exit_2(args, message) -> None:
    result = genlab("generate", "Once", "-m", str(STORIES), "-n", "4", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stdout == ""


def test_cli_beam_with_an_amateur_gives_the_library_beams(stories, llama2xs) -> None:
    import json

    prompt = "One day, a little bird"
    result = genlab("beam", prompt, "-m", str(STORIES), "-k", "3", "-n", "8",
                    "--amateur", str(LLAMA2XS), "--json")
    assert result.returncode == 0, result.stderr
    outputs = json.loads(result.stdout)["outputs"]
    settings = GenerationSettings(strategy="beam", num_beams=3, num_return_sequences=3,
                                  max_new_tokens=8, cd_beta=0.5)
    hypotheses = beam_search(with_amateur(stories, llama2xs), [stories.encode(prompt)],
                             settings)[0].hypotheses
    assert [o["token_ids"] for o in outputs] == [list(h.token_ids) for h in hypotheses]
    plain = beam_search(stories, [stories.encode(prompt)],
                        dataclasses.replace(settings, cd_beta=None))[0].hypotheses
    assert [list(h.token_ids) for h in plain] != [o["token_ids"] for o in outputs]


def test_cli_batch_lines_set_the_numbers_and_the_repl_and_stdin_agree(tmp_path) -> None:
    import json

    expert = genlab("generate", "Once upon a time", "-m", str(STORIES), "-n", "12").stdout
    lines = [{"id": 1, "prompt": "Once upon a time", "cd_beta": 0},
             {"id": 2, "prompt": "Once upon a time", "cd_beta": 2},
             {"id": 3, "prompt": "Once upon a time", "ensemble_mode": "mean"},
             {"id": 4, "prompt": "Once upon a time", "amateur": str(CODE_DRAFT)}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = genlab("generate", "--input", str(source), "--output", "-", "-m", str(STORIES),
                   "--amateur", str(LLAMA2XS), "-n", "12")
    assert batch.returncode == 1  # lines 3 and 4 failed, the others ran
    results = {r["id"]: r for r in map(json.loads, batch.stdout.splitlines())}
    assert results[1]["text"] + "\n" == expert
    assert "ensemble (ensemble_mode) or contrastive decoding (cd_beta), not both" in \
        results[3]["error"]
    assert "unknown setting 'amateur'" in results[4]["error"]  # a line names no model
    piped = subprocess.run([sys.executable, "-m", "cli", "generate", "-m", str(STORIES), "-n",
                            "12", "--amateur", str(LLAMA2XS), "--cd-beta", "2"], cwd=ROOT,
                           input="Once upon a time\n", capture_output=True, text=True,
                           timeout=300)
    assert piped.stdout == results[2]["text"] + "\n" != expert
    repl = subprocess.run([sys.executable, "-m", "cli", "generate", "-i", "-m", str(STORIES),
                           "-n", "12", "--amateur", str(LLAMA2XS)], cwd=ROOT,
                          input="/set cd_beta=2\nOnce upon a time\n/quit\n",
                          capture_output=True, text=True, timeout=300)
    assert results[2]["text"] in repl.stdout, repl.stdout + repl.stderr
