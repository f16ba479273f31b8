"""Beam search: parity with transformers' generate(num_beams=k), a hand-checked toy model,
beam sampling, diverse groups, the event stream and the `genlab beam` command."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from genlib.decoding.beam import beam_search, length_score
from genlib.generate import generate
from genlib.models.loading import LoadedModel
from genlib.settings.config import GenerationSettings
from tests.conftest import STORIES

PROMPTS = ["Once upon a time", "The little dog"]


def test_length_score_divides_by_length_to_the_penalty():
    assert length_score(-6.0, 3, 2.0) == -6.0 / 9
    assert length_score(-6.0, 3, 0.0) == -6.0  # no penalty: the plain sum
    assert length_score(-6.0, 0, 1.0) == -6.0  # an empty hypothesis counts as length 1
    scores = length_score(torch.tensor([-4.0, -8.0]), 4, 0.5)
    assert scores.tolist() == [-2.0, -4.0]


def beam(**changes) -> GenerationSettings:
    """Beam settings built directly, so num_beams=1 stays 1 (resolve_settings makes it 4)."""
    return GenerationSettings(strategy="beam", **changes)


def hf_beam(lm: LoadedModel, prompts: list[list[int]], s: GenerationSettings):
    """transformers' own beam search on the same (left-padded) prompts."""
    from genlib.backends.transformers import left_pad

    ids, mask = left_pad(prompts, lm.pad_id, lm.device)
    out = lm.model.generate(
        ids, attention_mask=mask, num_beams=s.num_beams, length_penalty=s.length_penalty,
        early_stopping=s.early_stopping, max_new_tokens=s.max_new_tokens,
        num_return_sequences=s.num_return_sequences, do_sample=False,
        no_repeat_ngram_size=s.no_repeat_ngram_size or None,
        repetition_penalty=s.repetition_penalty, min_new_tokens=s.min_new_tokens or None,
        eos_token_id=list(lm.eos_ids), pad_token_id=lm.pad_id,
        return_dict_in_generate=True, output_scores=True)
    rows = out.sequences[:, ids.shape[1]:].tolist()
    return rows, out.sequences_scores.tolist()


def assert_same_as_hf(lm: LoadedModel, prompts: list[list[int]], s: GenerationSettings):
    results = beam_search(lm, prompts, s)
    rows, scores = hf_beam(lm, prompts, s)
    mine = [h for r in results for h in r.hypotheses]
    assert len(mine) == len(rows)
    for hyp, row, score in zip(mine, rows, scores):
        assert list(hyp.token_ids) == row[:len(hyp.token_ids)]
        assert hyp.score == pytest.approx(score, rel=1e-5, abs=1e-6)
        if len(hyp.token_ids) < len(row):  # transformers pads shorter outputs
            assert hyp.finish_reason in ("eos", "stop")


@pytest.mark.parametrize("k, length_penalty, early_stopping, max_new", [
    (2, 1.0, False, 30),
    (4, 1.0, True, 30),
    (4, 0.5, "never", 24),
    (8, 2.0, False, 24),
    (3, -1.0, False, 20),
])
def test_parity_with_transformers_on_stories260k(stories, k, length_penalty, early_stopping,
                                                 max_new):
    s = beam(num_beams=k, length_penalty=length_penalty, early_stopping=early_stopping,
             max_new_tokens=max_new, num_return_sequences=k)
    assert_same_as_hf(stories, [stories.encode(PROMPTS[0])], s)


def test_parity_batched_prompts_and_processors(stories):
    s = beam(num_beams=3, max_new_tokens=20, num_return_sequences=2, no_repeat_ngram_size=3,
             repetition_penalty=1.3, min_new_tokens=4, early_stopping=True)
    assert_same_as_hf(stories, [stories.encode(p) for p in PROMPTS], s)


def test_parity_on_tiny_random_models(tiny):
    s = beam(num_beams=3, max_new_tokens=15, num_return_sequences=3, length_penalty=0.7)
    assert_same_as_hf(tiny, [tiny.encode(PROMPTS[0]), tiny.encode(PROMPTS[1])], s)


def test_one_beam_equals_greedy(stories):
    ids = stories.encode(PROMPTS[0])
    greedy = generate(stories, [ids], GenerationSettings(max_new_tokens=60))[0]
    hyp = beam_search(stories, [ids], beam(num_beams=1, max_new_tokens=60))[0].hypotheses[0]
    assert hyp.token_ids == greedy.token_ids
    assert hyp.logprobs == pytest.approx(greedy.logprobs, abs=1e-5)


def test_one_beam_with_a_processor_equals_greedy(stories):
    """transformers' generate(num_beams=1) decodes greedily, its processors on the logits;
    a beam of one too (the repetition penalty on log-probabilities picks other tokens)."""
    ids = stories.encode(PROMPTS[0])
    greedy = generate(stories, [ids], GenerationSettings(max_new_tokens=40,
                                                         repetition_penalty=1.3))[0]
    hyp = beam_search(stories, [ids], beam(num_beams=1, max_new_tokens=40,
                                           repetition_penalty=1.3))[0].hypotheses[0]
    assert hyp.token_ids == greedy.token_ids


def test_one_sampled_beam_follows_the_distribution(stories):
    """Beam sampling with one beam is sampling: the first token is drawn with the model's
    probability (p("▁g") = 0.64 here), not the best of several draws (p = 0.98)."""
    ids = stories.encode("Once upon a time, there was a little")
    with torch.no_grad():
        p = stories.model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    g = int(p.argmax())
    runs = 200
    drawn = sum(beam_search(stories, [ids], beam(num_beams=1, do_sample=True, seed=seed,
                                                 max_new_tokens=1))[0].hypotheses[0]
                .token_ids[0] == g for seed in range(runs))
    expected = float(p[g])
    assert expected == pytest.approx(0.64, abs=0.01)
    assert abs(drawn / runs - expected) < 4 * math.sqrt(expected * (1 - expected) / runs)


def test_placeholder_beams_are_not_results(toy):
    """With more beams than continuations (14 words after one step), the beams filled
    with DEAD placeholders are not shown as hypotheses: each result is a real one."""
    s = beam(num_beams=20, max_new_tokens=1, num_return_sequences=20)
    hyps = beam_search(toy, [[WORDS.index("The")]], s)[0].hypotheses
    assert sorted(h.token_ids for h in hyps) == [(i,) for i in range(len(WORDS))]
    assert all(h.score == pytest.approx(h.sum_logprob, abs=1e-4) for h in hyps)


def test_groups_without_a_diversity_penalty_are_plain_beam_searches(stories):
    """With diversity_penalty 0 each of G groups is a plain search of k/G beams, so the
    pooled results are that search's, each G times."""
    ids = [stories.encode(PROMPTS[1])]
    plain = beam_search(stories, ids, beam(num_beams=2, max_new_tokens=20,
                                           num_return_sequences=2))[0]
    grouped = beam_search(stories, ids, beam(num_beams=4, num_beam_groups=2,
                                             diversity_penalty=0.0, max_new_tokens=20,
                                             num_return_sequences=4))[0]
    expected = [h.token_ids for h in plain.hypotheses for _ in range(2)]
    assert [h.token_ids for h in grouped.hypotheses] == expected
    assert len({tuple(t) for t in expected}) == 2  # two different searches' results


def test_diverse_groups_differ(stories):
    ids = [stories.encode(PROMPTS[0])]
    plain = beam_search(stories, ids, beam(num_beams=4, max_new_tokens=16,
                                           num_return_sequences=4))[0]
    diverse = beam_search(stories, ids, beam(num_beams=4, num_beam_groups=2,
                                             diversity_penalty=5.0, max_new_tokens=16,
                                             num_return_sequences=4))[0]
    texts = [h.text for h in diverse.hypotheses]
    assert len(set(texts)) == 4
    assert texts != [h.text for h in plain.hypotheses]
    # group 1 was pushed off group 0's first token at every step: the two groups' first
    # tokens differ
    steps = diverse_tree_first_tokens(stories, ids)
    assert steps[0] != steps[1]


def diverse_tree_first_tokens(lm, ids):
    s = beam(num_beams=2, num_beam_groups=2, diversity_penalty=5.0, max_new_tokens=3)
    tree = beam_search(lm, ids, s, record_tree=True)[0].tree
    first = [c for step in tree if step.step == 0 for c in step.candidates if c.status == "kept"]
    return {c.group: c.token_id for c in first}


def test_hypothesis_fields_are_consistent(stories):
    s = beam(num_beams=4, max_new_tokens=60, length_penalty=1.0, num_return_sequences=4)
    for hyp in beam_search(stories, [stories.encode(PROMPTS[0])], s)[0].hypotheses:
        assert len(hyp.logprobs) == len(hyp.token_ids)
        assert hyp.sum_logprob == pytest.approx(sum(hyp.logprobs), abs=1e-6)
        assert hyp.score == pytest.approx(hyp.sum_logprob / len(hyp.token_ids), rel=1e-4)
        assert hyp.constraints_satisfied is None
        assert hyp.finish_reason in ("eos", "length")


def test_beam_sampling_is_seeded_and_uses_processors(stories):
    ids = [stories.encode(PROMPTS[0])]
    s = beam(num_beams=3, do_sample=True, seed=7, temperature=3.0, max_new_tokens=12,
             num_return_sequences=3)
    first = [h.token_ids for h in beam_search(stories, ids, s)[0].hypotheses]
    again = [h.token_ids for h in beam_search(stories, ids, s)[0].hypotheses]
    other = [h.token_ids for h in beam_search(
        stories, ids, dataclasses.replace(s, seed=8))[0].hypotheses]
    assert first == again
    assert first != other
    # top_k=1 leaves each beam one token: beam sampling then reproduces greedy decoding
    greedy = generate(stories, ids, GenerationSettings(max_new_tokens=12))[0]
    cut = beam(num_beams=2, do_sample=True, seed=1, top_k=1, max_new_tokens=12)
    assert beam_search(stories, ids, cut)[0].hypotheses[0].token_ids == greedy.token_ids


def test_stop_strings_end_beams(stories):
    s = beam(num_beams=3, max_new_tokens=16, stop_strings=("Lily",), num_return_sequences=3,
             early_stopping=True)
    for hyp in beam_search(stories, [stories.encode(PROMPTS[0])], s)[0].hypotheses:
        assert "Lily" not in hyp.text
    assert beam_search(stories, [stories.encode(PROMPTS[0])], s)[0].hypotheses[0] \
        .finish_reason == "stop"


def test_stream_dispatches_beam_with_scores(stories):
    from genlib.events import Finish, Prefill
    from genlib.generate import stream
    from genlib.settings.config import resolve_settings

    s = resolve_settings({"strategy": "beam", "num_beams": 3, "num_return_sequences": 2,
                          "max_new_tokens": 12})
    events = list(stream(stories, [stories.encode(p) for p in PROMPTS], s))
    assert isinstance(events[0], Prefill)
    finishes = [e for e in events if isinstance(e, Finish)]
    assert [f.row for f in finishes] == [0, 1, 2, 3]
    assert [f.prompt_index for f in finishes] == [0, 0, 1, 1]
    assert all(f.score is not None for f in finishes)
    assert finishes[0].score >= finishes[1].score


# A hand-built model: next-token probabilities depend on the last token only (the
# example of the seed notes / the Hugging Face "how to generate" blog).
WORDS = ["<eos>", "The", "nice", "dog", "car", "woman", "house", "guy", "and", "runs", "has",
         "is", "drives", "turns"]
TABLE = {"The": {"nice": 0.5, "dog": 0.4, "car": 0.1},
         "nice": {"woman": 0.4, "house": 0.3, "guy": 0.3},
         "dog": {"and": 0.05, "runs": 0.05, "has": 0.9},
         "car": {"is": 0.3, "drives": 0.5, "turns": 0.2}}


class WordTokenizer:
    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [WORDS.index(w) for w in text.split()]}

    def encode(self, text, add_special_tokens=False):
        return [WORDS.index(w) for w in text.split() if w in WORDS]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(" " + WORDS[i] for i in ids if not (skip_special_tokens and i == 0))

    def convert_ids_to_tokens(self, i):
        return WORDS[i]


class HistoryCache:
    """Keeps each row's tokens; reordered like a KV cache."""

    def __init__(self, ids):
        self.ids = ids

    def reorder_cache(self, rows):
        self.ids = self.ids.index_select(0, rows)


class TableModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=1,
                                  vocab_size=len(WORDS))
        self.head = torch.nn.Linear(1, len(WORDS), bias=False)
        probs = torch.full((len(WORDS), len(WORDS)), 1e-6)
        probs[:, 0] = 1.0  # after a last word, the sentence ends
        for word, nxt in TABLE.items():
            row = probs[WORDS.index(word)]
            row[0] = 1e-6
            for w, p in nxt.items():
                row[WORDS.index(w)] = p
        self.register_buffer("logits_table", (probs / probs.sum(-1, keepdim=True)).log())

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=True):
        if isinstance(past_key_values, HistoryCache):
            past_key_values.ids = torch.cat([past_key_values.ids, input_ids], 1)
        else:
            past_key_values = HistoryCache(input_ids)
        return SimpleNamespace(logits=self.logits_table[input_ids],
                               past_key_values=past_key_values)


@pytest.fixture(scope="module")
def toy():
    return LoadedModel(model=TableModel(), tokenizer=WordTokenizer(), ref="toy",
                       device=torch.device("cpu"), dtype=torch.float32, eos_ids=(0,), pad_id=0,
                       max_positions=None)


def test_toy_best_beam_is_known_by_hand(toy):
    s = beam(num_beams=2, max_new_tokens=3, length_penalty=0.0, early_stopping="never",
             num_return_sequences=2)
    result = beam_search(toy, [[WORDS.index("The")]], s, record_tree=True)[0]
    best, second = result.hypotheses
    assert best.text == " dog has" and best.finish_reason == "eos"
    assert best.score == pytest.approx(math.log(0.4 * 0.9), abs=1e-4)  # 0.36 > 0.5 * 0.4
    assert second.text == " nice woman"
    assert second.score == pytest.approx(math.log(0.5 * 0.4), abs=1e-4)
    greedy = generate(toy, [[WORDS.index("The")]], GenerationSettings(max_new_tokens=3))[0]
    assert greedy.text == " nice woman"
    step1 = {c.token: c.status for c in result.tree[1].candidates}  # as the text reads
    assert step1[" has"] == "kept" and step1[" woman"] == "kept" and step1[" house"] == "pruned"


def test_toy_length_penalty_and_early_stopping(toy):
    # with 3 beams, "nice house"/"nice guy" (0.15) also finish; n-best is ordered by score
    s = beam(num_beams=3, max_new_tokens=3, length_penalty=1.0, early_stopping=True,
             num_return_sequences=3)
    hyps = beam_search(toy, [[WORDS.index("The")]], s)[0].hypotheses
    assert [h.text for h in hyps][:2] == [" dog has", " nice woman"]
    assert hyps[0].score == pytest.approx(math.log(0.36) / 3, abs=1e-4)  # eos counts


runner = CliRunner()
MODEL = ["-m", str(STORIES)]


def test_cli_beam_json_has_nbest_and_greedy():
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "3", "-n", "12",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert len(data["outputs"]) == 3
    assert [h["index"] for h in data["outputs"]] == [1, 2, 3]  # ranks, as in the table
    assert data["greedy"]["text"].startswith(", there was a little girl named Lily")
    scores = [h["score"] for h in data["outputs"]]
    assert scores == sorted(scores, reverse=True)


def test_cli_beam_keeps_a_presets_own_num_return_sequences(tmp_path):
    """The n-best defaults to every beam; a preset's num_return_sequences: 1 was
    overridden by it as if the preset had said nothing."""
    preset = tmp_path / "one.yaml"
    preset.write_text("strategy: beam\nnum_beams: 3\nnum_return_sequences: 1\n")
    one = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-p", str(preset), "-n",
                              "6", "--json"])
    every = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "3", "-n", "6",
                                "--json"])
    assert one.exit_code == every.exit_code == 0, one.output + every.output
    best = json.loads(every.stdout)["outputs"]
    assert [o["token_ids"] for o in json.loads(one.stdout)["outputs"]] == \
        [best[0]["token_ids"]] and len(best) == 3


def test_cli_constraints_not_met_under_no_repeat_ngram_name_it():
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "2", "-n", "6",
                                 "--force", "dog dog", "--no-repeat-ngram-size", "1"])
    assert result.exit_code == 0, result.output
    assert "warning: some outputs do not contain every forced phrase (marked NOT met): the " \
        "search could not place them within max_new_tokens under --no-repeat-ngram-size; " \
        "raise --max-new-tokens or --num-beams, or lower --no-repeat-ngram-size" in \
        " ".join(result.stderr.split())


def test_cli_beam_tree_shows_kept_and_pruned():
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "2", "-n", "6",
                                 "--tree", "--tree-steps", "2"])
    assert result.exit_code == 0, result.output
    labels = [line.rstrip().rsplit("  ", 1)[-1] for line in result.stdout.splitlines()
              if "cum logprob=" in line]
    assert labels.count("kept") == 4  # 2 beams after each of the 2 steps drawn
    assert "pruned" in labels
    assert "tree cut after 2 of 6 steps" in result.stdout
    assert "greedy" in result.stdout


def test_cli_beam_tree_is_drawn_as_the_search_runs_on_a_terminal(monkeypatch):
    """On a terminal the tree is redrawn after each step it shows (one frame per step,
    each with the steps so far), and the final frame is the whole tree."""
    import io

    from rich.console import Console

    import cli.render

    screen = io.StringIO()
    monkeypatch.setattr(cli.render, "out", Console(file=screen, force_terminal=True,
                                                   width=140, color_system=None))
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "2", "-n", "6",
                                 "--tree", "--tree-steps", "3", "--no-greedy"])
    assert result.exit_code == 0, result.output
    frames = screen.getvalue().split("prompt 'Once upon a time'")[1:]
    kept = [sum(line.rstrip().rsplit("  ", 1)[-1] == "kept"
                for line in frame.split("beam search:")[0].splitlines()) for frame in frames]
    assert kept == [2, 4, 6, 6]  # one frame per step drawn, 2 beams kept at each, and the
    # last frame again as the view stops (it stays on the screen)
    assert "tree cut after 3 of 6 steps" in screen.getvalue() + result.stdout


def test_generate_runs_beam_preset():
    result = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-p", "beam", "-n",
                                 "10", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["settings"]["strategy"] == "beam" and "score" in data["outputs"][0]


def test_cli_sampling_preset_runs_beam_sampling():
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-p", "creative", "-k",
                                 "2", "-n", "6", "--seed", "5", "--json", "--no-greedy"])
    assert result.exit_code == 0, result.output
    settings = json.loads(result.stdout)["settings"]
    assert settings["do_sample"] is True and settings["seed"] == 5
    # the same rule under generate: beams over a sampling preset are beam sampling
    result = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-p", "creative",
                                 "-s", "beam", "-n", "6", "--seed", "5", "--json"])
    assert result.exit_code == 0, result.output
    settings = json.loads(result.stdout)["settings"]
    assert settings["strategy"] == "beam" and settings["do_sample"] is True
    assert "only apply when sampling" not in result.stderr  # temperature, top_p are used


def test_ctrl_c_returns_the_best_beams_so_far_marked_interrupted(stories, ctrl_c_at):
    ids = stories.encode(PROMPTS[0])
    ctrl_c_at(4)  # the 4th forward after the prefill: 4 tokens chosen
    [result] = beam_search(stories, [ids], beam(num_beams=3, num_return_sequences=2,
                                                max_new_tokens=20))
    assert len(result.hypotheses) == 2
    assert [len(h.token_ids) for h in result.hypotheses] == [4, 4]
    for hyp in result.hypotheses:
        assert hyp.finish_reason == "interrupted" and hyp.text
    assert result.hypotheses[0].score >= result.hypotheses[1].score


def test_ctrl_c_leaves_finished_searches_alone_and_trims_stop_strings(stories, ctrl_c_at):
    # Uninterrupted, both searches end on the stop string: "The little dog" after 9
    # tokens, "Once upon a time" after 11 (10 forwards after the prefill).
    settings = beam(num_beams=2, num_return_sequences=2, max_new_tokens=60,
                    stop_strings=(".",), early_stopping=True)
    prompts = [stories.encode(p) for p in PROMPTS]
    ctrl_c_at(10)  # the last forward: the second prompt's search is already done
    cut, finished = beam_search(stories, prompts, settings)
    assert [h.finish_reason for h in finished.hypotheses] == ["stop", "stop"]
    assert [len(h.token_ids) for h in finished.hypotheses] == [9, 9]
    assert [h.finish_reason for h in cut.hypotheses] == ["interrupted", "interrupted"]
    assert all("." not in h.text for h in cut.hypotheses + finished.hypotheses)
    # Cut after two of three hypotheses ended on the stop string (after 9 and 11 of
    # "The little dog"'s tokens): they rank among the results, still trimmed.
    ctrl_c_at(12)
    [result] = beam_search(stories, [prompts[1]], settings.replace(num_beams=3,
                                                                   num_return_sequences=3))
    lengths = sorted(len(h.token_ids) for h in result.hypotheses)
    assert 9 in lengths or 11 in lengths  # an ended hypothesis is among them
    assert all(h.finish_reason == "interrupted" for h in result.hypotheses)
    assert all("." not in h.text for h in result.hypotheses)


def test_cli_ctrl_c_shows_the_beams_so_far_and_exits_130(ctrl_c_at):
    ctrl_c_at(4)
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "3", "-n", "20"])
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stdout  # the n-best table, each row marked
    assert "greedy" not in result.stdout  # the contrast run is skipped
    assert "interrupted: the results above are those so far" in result.stderr
    ctrl_c_at(4)
    result = runner.invoke(app, ["generate", "Once upon a time", *MODEL, "-s", "beam",
                                 "-n", "20", "--json"])
    assert result.exit_code == 130, result.output
    assert json.loads(result.stdout)["outputs"][0]["finish_reason"] == "interrupted"


def test_cli_ctrl_c_in_the_greedy_contrast_run_exits_130(ctrl_c_at, monkeypatch):
    import genlib.generate

    real = genlib.generate.generate

    def contrast(*args, **kwargs):  # the contrast run: Ctrl-C during its 3rd step
        ctrl_c_at(3)
        return real(*args, **kwargs)

    monkeypatch.setattr(genlib.generate, "generate", contrast)
    result = runner.invoke(app, ["beam", "Once upon a time", *MODEL, "-k", "2", "-n", "8"])
    assert result.exit_code == 130, result.output
    greedy_row = next(line for line in result.stdout.splitlines() if "greedy" in line)
    assert "interrupted" in greedy_row  # shown, cut short, and the exit says so
    assert "interrupted: the results above are those so far" in result.stderr


def test_cli_bad_early_stopping_is_one_line_exit_2():
    result = runner.invoke(app, ["beam", "hi", *MODEL, "--early-stopping", "maybe"])
    assert result.exit_code == 2
    assert "early_stopping" in result.output and "Traceback" not in result.output


def test_the_tree_shows_tokens_as_the_text_reads_not_as_vocabulary_pieces():
    """A byte-level BPE vocabulary names a newline and indent "ĊĠĠĠ"; the tree, as
    explain and --logprobs, shows "\\n   ", and the best beam's tokens joined are its
    text."""
    result = runner.invoke(app, ["beam", "def add(a, b):", "-k", "2", "--tree", "-n",
                                      "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    shown = [c["token"] for step in out["tree"] for c in step["candidates"]]
    assert not any(ch in token for token in shown for ch in "ĠĊ"), shown
    assert "\n   " in shown  # the built-in model's first step: a newline and an indent
    tree = {(c["token_id"]): c["token"] for step in out["tree"] for c in step["candidates"]}
    best = out["outputs"][0]
    assert "".join(tree[t] for t in best["token_ids"]) == best["text"]


def test_beam_tokens_per_second_is_over_the_decode_time(stories):
    """Beam search settles most tokens at the end: timed from the first settled token,
    48 tokens over a few milliseconds read as tens of thousands of tokens/s. The first
    token is the search's first step, and the rate runs from there."""
    from genlib.events import BeamStep, Finish
    from genlib.generate import stream

    settings = beam(num_beams=4, max_new_tokens=30)
    events = list(stream(stories, [stories.encode("Once upon a time")], settings))
    first_step = next(e for e in events if isinstance(e, BeamStep))
    finish = next(e for e in events if isinstance(e, Finish))
    assert finish.new_tokens == 30
    assert finish.first_token == first_step.time
    decode = finish.end - first_step.time
    assert finish.tokens_per_second == pytest.approx((finish.new_tokens - 1) / decode)


def test_beam_search_ends_at_max_time_as_the_plain_loop_does(stories):
    """The time limit is the one Finisher's, counted from the loop's start for beam
    search as for the plain loop: a search whose clock has run out by its first step
    ends every hypothesis there, "time", far short of the token budget."""
    settings = beam(num_beams=2, num_return_sequences=2, max_new_tokens=500,
                    max_time=1e-9, ignore_eos=True)
    [result] = beam_search(stories, [stories.encode("Once upon a time")], settings)
    assert [h.finish_reason for h in result.hypotheses] == ["time", "time"]
    assert [len(h.token_ids) for h in result.hypotheses] == [1, 1]
    assert result.steps == 1


def _stream_interrupted_at(stories, settings, when):
    """Beam search's event stream, Ctrl-C thrown in (as the CLI throws it) right after
    the first event `when(event, seen)` picks; every event, the interruption's too."""
    from genlib.decoding.step import interrupt
    from genlib.generate import stream

    events = stream(stories, [stories.encode("Once upon a time")], settings)
    seen: list = []
    for event in events:
        seen.append(event)
        if when(event, seen):
            seen.extend(interrupt(events))
            break
    return seen


def _rows(seen):
    """Each row's Token ids, and its Finish events."""
    from genlib.events import Finish, Token

    tokens: dict[int, list[int]] = {}
    finishes: dict[int, list[Finish]] = {}
    for event in seen:
        if isinstance(event, Token):
            tokens.setdefault(event.row, []).append(event.token_id)
        elif isinstance(event, Finish):
            finishes.setdefault(event.row, []).append(event)
    return tokens, finishes


def test_ctrl_c_amid_a_steps_settled_tokens_keeps_every_token(stories):
    """Ctrl-C between two tokens one step settles: the row's Finish holds the whole
    hypothesis and its Token events are that hypothesis, none skipped."""
    from genlib.events import BeamStep, Token

    settings = beam(num_beams=2, max_new_tokens=30, ignore_eos=True)
    seen = _stream_interrupted_at(
        stories, settings,
        lambda e, s: isinstance(e, Token) and isinstance(s[-2], Token))
    tokens, finishes = _rows(seen)
    [finish] = finishes[0]
    steps = sum(isinstance(e, BeamStep) for e in seen)  # a token a step, every beam
    assert finish.reason == "interrupted" and steps > 2
    assert len(finish.token_ids) == steps and tuple(tokens[0]) == finish.token_ids


def test_ctrl_c_amid_the_final_finishes_ends_each_row_once(stories):
    from genlib.events import Finish

    settings = beam(num_beams=3, num_return_sequences=2, max_new_tokens=12)
    seen = _stream_interrupted_at(stories, settings, lambda e, s: isinstance(e, Finish))
    tokens, finishes = _rows(seen)
    assert sorted(finishes) == [0, 1]
    assert all(len(f) == 1 for f in finishes.values())
    assert all(tuple(tokens[r]) == f[0].token_ids for r, f in finishes.items())


def test_ctrl_c_before_beam_searchs_first_step(stories, ctrl_c_at):
    """No step has run: the stream ends each row "interrupted" with no tokens, as the
    plain loop does, and `search` goes on as KeyboardInterrupt (no beams to show)."""
    from genlib.decoding.beam import search
    from genlib.events import Finish

    settings = beam(num_beams=2, num_return_sequences=2, max_new_tokens=12)
    seen = _stream_interrupted_at(stories, settings,
                                  lambda e, s: type(e).__name__ == "Prefill")
    assert [(e.row, e.reason, e.token_ids) for e in seen if isinstance(e, Finish)] == \
        [(0, "interrupted", ()), (1, "interrupted", ())]
    run = search(stories, [stories.encode("Once upon a time")], settings)
    next(run)  # the Prefill event
    with pytest.raises(KeyboardInterrupt):
        run.throw(KeyboardInterrupt())
