"""Token-level ensembles (genlib.sampling.combine, genlib.backends.combined, `--ensemble`).

An ensemble of a model with itself at equal weights, in either mode, is that model;
an ensemble of two different models in mean mode takes the argmax of the mixture
computed here from each model's own transformers logits; the CLI refuses what cannot be
combined (another tokenizer, a weight that is not > 0) in one line with exit status 2.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from genlib.errors import ConfigError
from genlib.events import Prefill
from genlib.generate import generate, stream
from genlib.sampling.combine import (
    Partner,
    check_partner,
    mixture,
    parse_member,
    product,
    tokenizer_difference,
)
from genlib.settings.config import GenerationSettings
from tests.conftest import CODE_TARGET, LLAMA2XS, ROOT, STORIES

PROMPTS = {"stories": "Once upon a time",
           "code": "import os\nimport sys\n\n\ndef main(argv):\n    "}


def combined(lm, *partners: Partner):
    """`lm` with `partners` to combine with (each run on the backend a generation asks)."""
    return dataclasses.replace(lm, partners=partners)


def backend_of(lm, ids, settings, backend: str) -> str:
    return next(e for e in stream(lm, [ids], settings, backend=backend)
                if isinstance(e, Prefill)).backend


@pytest.mark.parametrize("mode", ["mean", "product"])
@pytest.mark.parametrize("backend", ["native", "transformers"])
@pytest.mark.parametrize("which", ["stories", "code"])
def test_an_ensemble_of_a_model_with_itself_is_that_model(stories, code_target, mode,
                                                          backend, which) -> None:
    lm = stories if which == "stories" else code_target
    ids = lm.encode(PROMPTS[which])
    alone = generate(lm, [ids], GenerationSettings(max_new_tokens=24), backend=backend)[0]
    doubled = combined(lm, Partner(lm, "ensemble"))
    settings = GenerationSettings(max_new_tokens=24, ensemble_mode=mode)
    assert generate(doubled, [ids], settings, backend=backend)[0].token_ids == alone.token_ids
    assert backend_of(doubled, ids, settings, backend) == backend


def transformers_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """log p(next | ids[:i+1]) for every position, from the transformers model."""
    with torch.no_grad():
        logits = lm.model(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_a_mean_ensemble_takes_the_argmax_of_the_mixture(stories, llama2xs, backend) -> None:
    ids = stories.encode("One day, a little bird")  # the two models part at step 6
    weight = 0.5  # llama2xs's, beside stories260K's 1: weights 2/3 and 1/3
    lm = combined(stories, Partner(llama2xs, "ensemble", weight))
    out = generate(lm, [ids], GenerationSettings(max_new_tokens=20, ensemble_mode="mean"),
                   backend=backend)[0]
    full = ids + list(out.token_ids)
    a, b = transformers_logprobs(stories, full), transformers_logprobs(llama2xs, full)
    mix = torch.logaddexp(a + torch.log(torch.tensor(2 / 3)), b + torch.log(torch.tensor(1 / 3)))
    for step, token in enumerate(out.token_ids):  # teacher-forced: each step's argmax
        position = len(ids) - 1 + step
        assert int(mix[position].argmax()) == token, step
    alone = generate(stories, [ids], GenerationSettings(max_new_tokens=20), backend=backend)[0]
    assert alone.token_ids != out.token_ids  # the partner changed the output


def test_mixture_and_product_on_hand_written_distributions() -> None:
    p = torch.tensor([[0.7, 0.2, 0.1]]).log()
    q = torch.tensor([[0.1, 0.1, 0.8]]).log()
    mixed = mixture([p, q], (0.25, 0.75)).exp()
    assert torch.allclose(mixed, torch.tensor([[0.25, 0.125, 0.625]]))
    prod = product([p, q], (0.5, 0.5)).exp()
    geometric = torch.tensor([0.07, 0.02, 0.08]).sqrt()
    assert torch.allclose(prod, geometric[None] / geometric.sum())
    assert int(mixed.argmax()) == 2 and int(product([p, q], (0.9, 0.1)).argmax()) == 0


def test_beam_search_reorders_every_models_cache(stories, llama2xs) -> None:
    ids = stories.encode(PROMPTS["stories"])
    lm = combined(stories, Partner(llama2xs, "ensemble"))
    settings = GenerationSettings(strategy="beam", num_beams=3, max_new_tokens=12,
                                  ensemble_mode="product")
    native = generate(lm, [ids], settings, backend="native")[0]
    reference = generate(lm, [ids], settings, backend="transformers")[0]
    assert native.token_ids == reference.token_ids


def test_a_combination_the_settings_ask_for_needs_its_models(stories) -> None:
    ids = stories.encode("Once")
    with pytest.raises(ConfigError, match="give --ensemble MODEL"):
        generate(stories, [ids], GenerationSettings(max_new_tokens=2, ensemble_mode="mean"))
    with pytest.raises(ConfigError, match="not both"):
        GenerationSettings(ensemble_mode="mean", cd_beta=0.5)


def test_a_partner_too_short_for_the_generation_is_named(stories, llama2xs) -> None:
    lm = combined(stories, Partner(llama2xs, "ensemble"))
    ids = stories.encode(PROMPTS["stories"])
    with pytest.raises(Exception, match="llama2xs's 256 positions"):
        generate(lm, [ids], GenerationSettings(max_new_tokens=300, ensemble_mode="mean"),
                 backend="native")


def test_tokenizers_are_compared_id_by_id(stories, llama2xs, code_target) -> None:
    assert tokenizer_difference(stories.tokenizer, llama2xs.tokenizer) is None
    difference = tokenizer_difference(stories.tokenizer, code_target.tokenizer)
    assert difference is not None and difference.startswith("first at token id 0: ")
    with pytest.raises(ConfigError, match=r"^--ensemble .*code-target: its tokenizer "
                       r"differs .*first at token id 0"):
        check_partner(stories, code_target, "--ensemble")


def test_a_partner_on_another_device_is_refused(stories, llama2xs) -> None:
    elsewhere = dataclasses.replace(llama2xs, device=torch.device("meta"))
    with pytest.raises(ConfigError, match="is on meta .* one device: give --device"):
        check_partner(stories, elsewhere, "--amateur")


@pytest.mark.parametrize(("text", "parsed"), [
    ("../m:0.5", ("../m", 0.5)), ("../m", ("../m", 1.0)),
    ("builtin:code-small", ("builtin:code-small", 1.0)), ("a:b:2", ("a:b", 2.0))])
def test_members_parse_with_an_optional_weight(text, parsed) -> None:
    assert parse_member(text) == parsed


@pytest.mark.parametrize("text", ["../m:-1", "../m:0", "../m:nan", ":2"])
def test_members_with_a_bad_weight_are_refused(text) -> None:
    with pytest.raises(ConfigError, match="--ensemble"):
        parse_member(text)


def test_the_combined_backend_names_every_part(stories, llama2xs) -> None:
    lm = combined(stories, Partner(llama2xs, "ensemble"))
    events = list(stream(lm, [stories.encode("Once")],
                         GenerationSettings(max_new_tokens=2, ensemble_mode="mean")))
    prefill = next(e for e in events if isinstance(e, Prefill))
    assert prefill.backend == "native"
    assert "mean ensemble of" in prefill.backend_reason and "llama2xs" in prefill.backend_reason


# ---------------------------------------------------------------- the command line

def genlab(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_ensemble_of_a_model_with_itself_prints_its_greedy_text() -> None:
    alone = genlab("generate", "Once upon a time", "-m", str(STORIES), "-n", "16")
    both = genlab("generate", "Once upon a time", "-m", str(STORIES), "-n", "16",
                  "--ensemble", f"{STORIES}:1", "--ensemble-mode", "product")
    assert alone.returncode == both.returncode == 0, both.stderr
    assert both.stdout == alone.stdout
    assert alone.stdout.startswith(", there was a little girl named Lily")


def test_cli_refuses_another_tokenizer_in_one_line() -> None:
    result = genlab("generate", "Once", "-m", str(STORIES), "-n", "4",
                    "--ensemble", str(CODE_TARGET))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "first at token id 0" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(("args", "message"), [
    (["--ensemble", f"{LLAMA2XS}:-0.5"], "the weight must be a number > 0"),
    (["--ensemble-mode", "mean"], "--ensemble-mode needs --ensemble"),
    (["--ensemble", str(LLAMA2XS), "--ensemble-mode", "median"], "mean, product"),
    (["--ensemble", str(LLAMA2XS), "--amateur", str(LLAMA2XS)], "not both"),
])
def test_cli_bad_ensemble_input_is_one_line_and_exit_2(args, message) -> None:
    result = genlab("generate", "Once", "-m", str(STORIES), "-n", "4", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr


def test_cli_explain_shows_each_models_probability_beside_the_combined_one() -> None:
    import json

    args = ("explain", "Once upon a time", "-m", str(STORIES), "-n", "4", "--json")
    alone = json.loads(genlab(*args).stdout)
    result = genlab(*args, "--ensemble", f"{LLAMA2XS}:0.5")
    assert result.returncode == 0, result.stderr
    both = json.loads(result.stdout)
    for mine, step in zip(alone["original"]["steps"], both["original"]["steps"]):
        for c in [step["chosen"], *step["candidates"]]:
            own = c["model_probs"]
            assert list(own) == [str(STORIES), str(LLAMA2XS)]
            mixed = 2 / 3 * own[str(STORIES)] + 1 / 3 * own[str(LLAMA2XS)]
            assert c["stage_probs"]["raw"] == pytest.approx(mixed, rel=1e-4, abs=1e-9)
        assert step["chosen"]["model_probs"][str(STORIES)] == pytest.approx(
            mine["chosen"]["stage_probs"]["raw"], rel=1e-5)
    assert "model_probs" not in alone["original"]["steps"][0]["chosen"]


def test_cli_compare_puts_contrastive_decoding_beside_greedy() -> None:
    import json

    result = genlab("compare", "Once upon a time", "-m", str(STORIES), "-n", "12",
                    "-p", "greedy", "-p", "cd", "--amateur", str(LLAMA2XS), "--json")
    assert result.returncode == 0, result.stderr
    columns = {r["label"]: r for r in json.loads(result.stdout)["strategies"]}
    assert columns["cd"]["settings"]["cd_beta"] == 0.5 and columns["cd"]["error"] is None
    assert columns["greedy"]["settings"]["cd_beta"] is None
    greedy = genlab("generate", "Once upon a time", "-m", str(STORIES), "-n", "12")
    assert columns["greedy"]["outputs"][0]["text"] + "\n" == greedy.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["-p", "cd"], "strategy 'cd' combines models: give --amateur MODEL"),
    (["-p", "greedy", "--amateur", str(LLAMA2XS)], "no strategy does"),
])
def test_cli_compare_refuses_combinations_without_their_models(args, message) -> None:
    result = genlab("compare", "Once", "-m", str(STORIES), "-n", "4", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
