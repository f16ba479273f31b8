"""Sample and rerank (genlib.decoding.rerank, `generate --samples N --rerank ...`): the scores it
reports are what they say, and the kept sample is the best by them."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from genlib.decoding import rerank
from genlib.errors import ConfigError
from genlib.events import Finish, Rerank, Token
from genlib.generate import stream
from genlib.settings.config import resolve_settings
from tests.conftest import CODE_TARGET, LLAMA2XS, STORIES
from tests.test_output import errors as schema_errors

runner = CliRunner()
PROMPT = "Once upon a time"


def run(lm, settings, scorer=None):
    """(the Rerank event, the output's Finish, the output's Token events)."""
    events = list(stream(lm, [lm.encode(PROMPT)], settings, scorer=scorer))
    (event,) = [e for e in events if isinstance(e, Rerank)]
    (finish,) = [e for e in events if isinstance(e, Finish)]
    return event, finish, [e for e in events if isinstance(e, Token)]


def mean_logprob_by_forward(model, prompt_ids, sample_ids) -> float:
    """The sample's mean token logprob from transformers' forward of prompt + sample."""
    ids = torch.tensor([list(prompt_ids) + list(sample_ids)])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].double().log_softmax(-1)
    start = len(prompt_ids) - 1
    return float(sum(logp[start + i, t] for i, t in enumerate(sample_ids)) / len(sample_ids))


# --- chrF and the choice --------------------------------------------------------------

@pytest.mark.parametrize("hypothesis, reference, expected", [
    # sacrebleu's own test values (test/test_chrf.py, effective order; precision equals
    # recall there, so beta does not matter)
    ("a", "a", 100.0), ("a b c", "abc", 100.0), ("aa", "ab", 25.0), ("", "reference", 0.0),
    # by hand, beta 2: 1-grams P = 1, R = 2/3; 2-grams P = 1, R = 1/2; no 3-gram in
    # "ab": P = 1, R = 7/12, F2 = 5PR / (4P + R) = 0.636363...
    ("ab", "abc", 100 * 5 * (7 / 12) / (4 + 7 / 12)),
    # swapped: P = 7/12, R = 1, F2 = 0.875
    ("abc", "ab", 87.5),
])
def test_chrf_matches_known_values(hypothesis, reference, expected):
    assert rerank.chrf(hypothesis, reference) == pytest.approx(expected, abs=1e-6)


def test_mbr_picks_the_medoid():
    """Each other text changes one word of the third, a different word each: any two of
    them differ in two words, the third from each in one. The third is the medoid."""
    texts = ["big fox runs fast home", "red cat runs fast home", "red fox runs fast home",
             "red fox hops fast home", "red fox runs slow home"]
    scores = rerank.mbr_scores(texts)
    for i, score in enumerate(scores):
        others = [rerank.chrf(texts[i], t) for j, t in enumerate(texts) if j != i]
        assert score == pytest.approx(sum(others) / 4)
    assert rerank.choose(scores) == 2
    assert rerank.mbr_scores(["same", "same", ""])[2] is None


def test_choose_takes_the_highest_score_first_of_equals_and_never_none():
    assert rerank.choose([-3.0, -1.0, -2.0]) == 1
    assert rerank.choose([None, -5.0, -0.5, None]) == 2
    assert rerank.choose([-1.0, -1.0]) == 0
    assert rerank.choose([None, None]) == 0


# --- scores on real models ------------------------------------------------------------

def test_logprob_rerank_scores_are_mean_logprobs_and_it_keeps_the_best(stories):
    settings = resolve_settings({"samples": 5, "max_new_tokens": 16, "seed": 7,
                                 "temperature": 0.8, "top_k": 40})
    event, finish, tokens = run(stories, settings)
    prompt_ids = stories.encode(PROMPT)
    assert event.method == "logprob" and len(event.samples) == 5
    assert len({s.text for s in event.samples}) > 1  # distinct samples: a choice to make
    for sample, score in zip(event.samples, event.scores):
        expected = mean_logprob_by_forward(stories.model, prompt_ids, sample.token_ids)
        assert score == pytest.approx(expected, abs=1e-4)
    assert event.chosen == max(range(5), key=lambda i: event.scores[i])
    best = event.samples[event.chosen]
    assert (finish.row, finish.text, finish.token_ids) == (0, best.text, best.token_ids)
    assert finish.score == event.scores[event.chosen]
    assert [t.token_id for t in tokens] == list(best.token_ids)  # only the kept one streams
    assert {t.row for t in tokens} == {0}


def test_a_scoring_model_scores_by_its_own_forward(stories, llama2xs):
    settings = resolve_settings({"samples": 4, "max_new_tokens": 16, "seed": 3,
                                 "rerank": str(LLAMA2XS)})
    event, finish, _ = run(stories, settings, scorer=llama2xs)
    prompt_ids = stories.encode(PROMPT)
    own = [rerank.scores("logprob", None, prompt_ids, [s])[0] for s in event.samples]
    for sample, score, mine in zip(event.samples, event.scores, own):
        expected = mean_logprob_by_forward(llama2xs.model, prompt_ids, sample.token_ids)
        assert score == pytest.approx(expected, abs=1e-4)
        assert abs(score - mine) > 1e-3  # another model's judgement, not the generator's
    assert event.chosen == max(range(4), key=lambda i: event.scores[i])
    assert finish.text == event.samples[event.chosen].text


def test_a_scoring_model_with_another_tokenizer_is_refused(stories, code_target):
    settings = resolve_settings({"samples": 2, "max_new_tokens": 4, "rerank": str(CODE_TARGET)})
    with pytest.raises(ConfigError, match="token id 0 is '<|endoftext|>' there"):
        next(stream(stories, [stories.encode(PROMPT)], settings, scorer=code_target))


def test_samples_is_one_batch_of_rows_seeded_per_prompt(stories):
    """Sample i of a prompt draws what row i of num_return_sequences draws."""
    settings = resolve_settings({"samples": 3, "max_new_tokens": 12, "seed": 11})
    event, _, _ = run(stories, settings)
    plain = resolve_settings({"num_return_sequences": 3, "max_new_tokens": 12, "seed": 11,
                              "temperature": 1.0})
    rows = sorted((e for e in stream(stories, [stories.encode(PROMPT)], plain)
                   if isinstance(e, Finish)), key=lambda f: f.row)
    assert [s.token_ids for s in event.samples] == [f.token_ids for f in rows]


# --- the command line -----------------------------------------------------------------

def invoke(*args: str):
    return runner.invoke(app, ["generate", PROMPT, "-m", str(STORIES), "-n", "12", *args])


@pytest.mark.parametrize("args, message", [
    (["--samples", "0"], "samples must be 1 <= samples <= 1024, got 0"),
    (["--samples", "-2"], "samples must be 1 <= samples <= 1024, got -2"),
    (["--rerank", "mbr"], "rerank 'mbr' needs samples: give --samples N"),
    (["--samples", "3", "--rerank", "bleu"], "unknown rerank 'bleu': give logprob, mbr"),
    (["--samples", "3", "-s", "greedy"], "it needs strategy sample, not greedy"),
    (["--samples", "1", "--rerank", "mbr"], "give samples >= 2"),
    (["--samples", "3", "--rerank", str(CODE_TARGET)],
     f"has another tokenizer than {STORIES}: token id 0 is '<|endoftext|>' there"),
])
def test_bad_rerank_requests_give_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_json_lists_every_sample_and_the_text_is_the_chosen_one():
    result = invoke("--samples", "4", "--rerank", "mbr", "--seed", "5", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert schema_errors(doc) == []
    block = doc["rerank"]
    assert block["method"] == "mbr" and "chrF" in block["score"]
    assert [s["index"] for s in block["samples"]] == [1, 2, 3, 4]
    chosen = [s for s in block["samples"] if s["chosen"]]
    assert len(chosen) == 1 and chosen[0]["index"] == block["chosen"]
    assert chosen[0]["score"] == max(s["score"] for s in block["samples"])
    (output,) = doc["outputs"]
    assert (output["text"], output["score"]) == (chosen[0]["text"], chosen[0]["score"])
    text = invoke("--samples", "4", "--rerank", "mbr", "--seed", "5", "--stats")
    assert text.exit_code == 0, text.output
    assert text.stdout == chosen[0]["text"] + "\n"
    assert "rerank: mbr" in text.stderr and f"{chosen[0]['score']:.4f}" in text.stderr


def test_the_interactive_session_prints_the_kept_sample_and_scores_with_a_model(tmp_path):
    from tests.test_repl import errors, piped

    saved = tmp_path / "session.jsonl"
    result = piped(tmp_path, ["Once upon a time", "/branch 2 #3", "/set rerank=mbr",
                              "Once upon a time", f"/save {saved}"],
                   "-n", "8", "--seed", "5", "--samples", "3", "--rerank", str(LLAMA2XS))
    assert result.returncode == 0, result.stderr
    assert errors(result.stderr) == [
        "error: /branch replays one drawn answer, and this one was kept from samples drawn "
        "apart; /set samples= rerank= to draw one"]
    turns = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [(t["settings"]["samples"], t["settings"]["rerank"]) for t in turns] == [
        (3, str(LLAMA2XS)), (3, "mbr")]
    # the kept samples only (the session ends its last line on leaving)
    assert result.stdout == "".join(t["output"] + "\n" for t in turns) + "\n"


def test_batch_lines_rerank_as_generate_does_and_never_name_a_model(tmp_path):
    lines = [{"id": "x", "prompt": PROMPT, "samples": 3, "rerank": "mbr", "seed": 5},
             {"id": "y", "prompt": "The dog", "samples": 3, "rerank": "mbr", "seed": 6},
             {"id": "z", "prompt": PROMPT, "samples": 3, "rerank": str(LLAMA2XS)}]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(app, ["generate", "-m", str(STORIES), "-n", "12", "--input",
                               str(source), "-o", str(results)])
    assert done.exit_code == 1, done.output  # a line failed
    by_id = {r["id"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert by_id["z"]["error"] == (f"line 3: rerank {str(LLAMA2XS)!r} is not logprob or mbr; "
                                   f"a batch reranks by those two (a scoring model reranks "
                                   f"one-off prompts and the interactive session)")
    alone = json.loads(invoke("--samples", "3", "--rerank", "mbr", "--seed", "5",
                              "--json").stdout)["outputs"][0]
    assert (by_id["x"]["text"], by_id["x"]["score"]) == (alone["text"], alone["score"])
    assert by_id["y"]["settings"]["samples"] == 3 and by_id["y"]["score"] is not None


def test_compare_runs_rerank_beside_the_samples_it_chooses_from(stories):
    """Under common random numbers the rerank preset's 8 samples are the 8 samples of
    plain sampling at its temperature: it keeps the one of best mean logprob."""
    from genlib.lab import compare, metrics

    strategies = compare.build_strategies(["rerank"], ["temperature=1.0"],
                                          {"max_new_tokens": 12}, samples=8)
    result = compare.compare(stories, stories.encode(PROMPT),
                             compare.sharing_seed(strategies, 4), seed=4)
    reranked, plain = result.results
    assert reranked.error is None and plain.error is None
    assert len(reranked.samples) == 1 and len(plain.samples) == 8
    means = [metrics.mean_logprob(s.logprobs) for s in plain.samples]
    assert len(set(means)) > 1
    (kept,) = reranked.samples
    assert kept.token_ids == plain.samples[rerank.choose(means)].token_ids
    assert kept.score == pytest.approx(max(means))


def test_ctrl_c_reranks_the_samples_drawn_so_far(stories, ctrl_c_at):
    settings = resolve_settings({"samples": 3, "max_new_tokens": 12, "seed": 2})
    ctrl_c_at(4)  # the 4th step after the prefill: 4 tokens a sample
    event, finish, tokens = run(stories, settings)
    assert [(s.reason, s.new_tokens) for s in event.samples] == [("interrupted", 4)] * 3
    assert finish.reason == "interrupted"
    assert finish.token_ids == event.samples[event.chosen].token_ids
    assert len(tokens) == 4
