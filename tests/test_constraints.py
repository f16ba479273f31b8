"""Constrained beam search: constraint states on hand-written token sequences, the bank
round robin, and searches whose every output must contain the forced phrases."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from genlib.decoding.beam import beam_search
from genlib.errors import ConfigError
from genlib.sampling import constraints as cons
from genlib.settings.config import GenerationSettings
from tests.conftest import STORIES
from tests.test_beam import WORDS, toy  # noqa: F401  (the hand-built model fixture)

PHRASE = cons.Constraint("a b c", ((5, 6, 7),))
EITHER = cons.Constraint("x|y z", ((8,), (9, 10)))


def run(constraints, tokens):
    state = cons.initial_state(constraints)
    for token in tokens:
        state = cons.advance(constraints, state, token)
    return state


def test_phrase_progress_resets_and_overlaps():
    assert run([PHRASE], [5, 6]) == ((2,),)
    assert run([PHRASE], [5, 6, 5]) == ((1,),)  # broken phrase restarts at its new start
    assert run([PHRASE], [5, 5, 6, 7]) == (None,)  # "a a b c" still contains "a b c"
    assert cons.satisfied(run([PHRASE], [1, 5, 6, 7, 2]))


def test_disjunctive_set_is_met_by_any_phrase():
    assert cons.satisfied(run([EITHER], [8]))
    assert cons.satisfied(run([EITHER], [9, 10]))
    assert run([EITHER], [9]) == ((0, 1),)
    assert cons.advancing_tokens([EITHER], run([EITHER], [9])) == {8, 10}


def test_bank_counts_met_and_partial_tokens():
    both = [PHRASE, EITHER]
    assert cons.bank(both, run(both, [])) == 0
    assert cons.bank(both, run(both, [5, 6])) == 2
    assert cons.bank(both, run(both, [5, 6, 7, 8])) == 3 + 2  # met: longest phrase length


def test_round_robin_takes_the_best_of_each_bank_in_turn():
    banks = [0, 0, 0, 1, 1, 2]
    scores = [-1.0, -2.0, -3.0, -5.0, -4.0, -9.0]
    # best of bank 2, of bank 1, of bank 0, then the second of bank 1, of bank 0, ...
    assert cons.round_robin(banks, scores) == [5, 4, 0, 3, 1, 2]


def beam(**changes) -> GenerationSettings:
    return GenerationSettings(strategy="beam", **changes)


def test_toy_forced_word_changes_the_best_beam(toy):  # noqa: F811
    s = beam(num_beams=2, max_new_tokens=3, force_words=("car",), num_return_sequences=2)
    hyps = beam_search(toy, [[WORDS.index("The")]], s)[0].hypotheses
    # unconstrained, " dog has" wins; forcing "car" makes " car drives" (0.1 * 0.5) the best,
    # and the bank of beams that have not met it yet still reaches " nice woman car"
    assert [h.text for h in hyps] == [" car drives", " nice woman car"]
    assert all(h.constraints_satisfied for h in hyps)


def test_toy_impossible_constraint_is_reported_not_met(toy):  # noqa: F811
    # "The" is in the prompt and no_repeat_ngram_size=1 bans it: it can never be generated
    s = beam(num_beams=2, max_new_tokens=3, force_words=("The",), no_repeat_ngram_size=1)
    hyp = beam_search(toy, [[WORDS.index("The")]], s)[0].hypotheses[0]
    assert hyp.constraints_satisfied is False


def test_phrase_longer_than_the_budget_is_a_config_error(toy):  # noqa: F811
    s = beam(num_beams=2, max_new_tokens=2, force_words=("dog has",), force_any=("car|guy",))
    with pytest.raises(ConfigError, match="need at least 3 tokens"):
        beam_search(toy, [[WORDS.index("The")]], s)


def test_every_output_contains_its_forced_phrases(stories):
    s = beam(num_beams=4, max_new_tokens=24, force_words=("dog",), force_any=("cat|bird",),
             num_return_sequences=4)
    for hyp in beam_search(stories, [stories.encode("Once upon a time")], s)[0].hypotheses:
        assert hyp.constraints_satisfied
        assert "dog" in hyp.text
        assert "cat" in hyp.text or "bird" in hyp.text


def test_cli_force_and_impossible_budget():
    runner = CliRunner()
    ok = runner.invoke(app, ["beam", "Once upon a time", "-m", str(STORIES), "-k", "3", "-n",
                             "16", "--force", "dog", "--json", "--no-greedy"])
    assert ok.exit_code == 0, ok.output
    hypotheses = json.loads(ok.stdout)["outputs"]
    assert hypotheses and all("dog" in h["text"] and h["constraints_satisfied"]
                              for h in hypotheses)
    bad = runner.invoke(app, ["beam", "hi", "-m", str(STORIES), "-n", "2", "--force",
                              "elephant in the room"])
    assert bad.exit_code == 2
    assert "max_new_tokens" in bad.output and "Traceback" not in bad.output


def test_a_forced_word_matches_its_mid_text_spelling_on_byte_level_bpe():
    """Byte-level BPE spells " return" as one token unlike "return": both count."""
    from transformers import AutoTokenizer

    from genlib.models.loading import DEFAULT_MODEL
    from genlib.sampling.constraints import _spellings

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))
    texts = {tok.decode(list(s)) for s in _spellings(tok, "return")}
    assert texts == {"return", " return"}


def test_spaces_around_the_bars_of_a_set_do_not_change_it(stories):
    from genlib.sampling.constraints import build_constraints

    tight, = build_constraints(stories.tokenizer, [], ["cat|bird"], 8)
    spaced, = build_constraints(stories.tokenizer, [], ["cat | bird "], 8)
    assert spaced.phrases == tight.phrases


def test_a_forced_phrase_holding_a_stop_string_is_refused(stories):
    """The output would end at the stop string and its text be cut there: the phrase
    could never be shown, though the output would be marked as meeting it."""
    from genlib.sampling.constraints import build_constraints

    with pytest.raises(ConfigError, match="'big dog' contains the stop string 'g d'"):
        build_constraints(stories.tokenizer, [], ["cat|big dog"], 8, ("g d",))
    assert build_constraints(stories.tokenizer, ["dog"], [], 8, (".",))
    bad = CliRunner().invoke(app, ["beam", "Once upon a time", "-m", str(STORIES), "-k", "2",
                                   "-n", "8", "--force", "dog", "--stop", "dog"])
    assert bad.exit_code == 2
    assert bad.stdout == ""
    assert "forced phrase 'dog' contains the stop string 'dog'" in bad.stderr
    assert "Traceback" not in bad.output
