"""Grammar-constrained generation (xgrammar): JSON schema, regex and EBNF output on the
built-in model, in batches, beam search and speculative decoding; unfinished output
ends with its own finish reason; the CLI flags and their errors."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings

import jsonschema
import pytest
import torch

pytest.importorskip("xgrammar", reason="the grammar extra: pip install 'genlab[grammar]'")
from typer.testing import CliRunner

from cli.main import app
from genlib import generate
from genlib.decoding.beam import beam_search
from genlib.decoding.speculative import speculative_stream
from genlib.errors import ConfigError, GenlabWarning
from genlib.events import Verify
from genlib.models.loading import DEFAULT_DRAFT, DEFAULT_MODEL, ModelSpec, load_model
from genlib.sampling import grammar, processors
from genlib.settings.config import resolve_settings

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
PROMPT = "def config():\n    return "


@pytest.fixture(scope="module")
def builtin():
    return load_model(ModelSpec(str(DEFAULT_MODEL)))


def is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def test_schema_output_validates_for_20_seeds_where_the_model_alone_does_not(builtin):
    ids = builtin.encode(PROMPT)
    seeds = list(range(20))
    constrained = resolve_settings({"json_schema": SCHEMA, "temperature": 1.0,
                                    "max_new_tokens": 48})
    finishes = generate.generate(builtin, [ids] * 20, constrained, seeds=seeds)
    assert [f.reason for f in finishes] == ["eos"] * 20
    assert all(is_valid(f.text) for f in finishes), [f.text for f in finishes]
    assert len({f.text for f in finishes}) > 5  # sampled, not one forced string
    unconstrained = resolve_settings({"temperature": 1.0, "max_new_tokens": 48})
    alone = generate.generate(builtin, [ids] * 20, unconstrained, seeds=seeds)
    assert sum(is_valid(f.text) for f in alone) <= 2


def test_a_budget_too_small_for_the_grammar_ends_incomplete(builtin):
    settings = resolve_settings({"json_schema": SCHEMA, "max_new_tokens": 4})
    [finish] = generate.generate(builtin, [builtin.encode(PROMPT)], settings)
    assert finish.reason == grammar.INCOMPLETE
    assert not is_valid(finish.text)


UNENFORCED = {"allOf": [{"type": "integer"}, {"minimum": 5}]}  # xgrammar: "still ongoing"


def test_output_the_grammar_ends_but_the_schema_refuses_is_schema_invalid(builtin):
    """xgrammar does not enforce every keyword: such output ended `length` or `eos`, and
    exit 0, as if valid. The finish reason follows jsonschema's verdict on the text."""
    seeds = list(range(8))
    settings = resolve_settings({"json_schema": UNENFORCED, "temperature": 1.0,
                                 "max_new_tokens": 12})
    finishes = generate.generate(builtin, [builtin.encode("x = ")] * 8, settings, seeds=seeds)
    for finish in finishes:
        try:
            valid = jsonschema.validators.validator_for(UNENFORCED)(UNENFORCED).is_valid(
                json.loads(finish.text))
        except json.JSONDecodeError:
            valid = False
        if finish.reason != grammar.INCOMPLETE:
            assert (finish.reason == grammar.INVALID) == (not valid), finish
    assert grammar.INVALID in [f.reason for f in finishes]  # the case is met here


def test_finish_reason_checks_finished_output_against_the_schema():
    class Stub:
        valid = staticmethod(lambda tokens: list(tokens) == [1])

        @staticmethod
        def complete(tokens):
            return True

    assert grammar.finish_reason(Stub(), [1], "eos") == "eos"
    assert grammar.finish_reason(Stub(), [2], "eos") == grammar.INVALID
    assert grammar.finish_reason(Stub(), [2], "length") == grammar.INVALID
    assert grammar.finish_reason(Stub(), [2], "stop") == "stop"  # cut where the user asked
    assert grammar.finish_reason(None, [2], "eos") == "eos"


def test_cli_schema_invalid_output_warns_and_exits_1(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(UNENFORCED))
    result = runner.invoke(app, ["generate", "x = ", "--json-schema", str(schema), "-n", "12",
                                 "-t", "1", "--seed", "0", "--num-return-sequences", "8",
                                 "--json"])
    reasons = [o["finish_reason"] for o in json.loads(result.stdout)["outputs"]]
    assert grammar.INVALID in reasons
    assert result.exit_code == 1
    assert "the text is NOT valid against the JSON schema" in " ".join(result.stderr.split())


def test_regex_and_ebnf_outputs_match(builtin):
    ids = builtin.encode("x = ")
    pattern = r"[a-z]{2,5}_[0-9]{1,3}"
    [regex] = generate.generate(builtin, [ids], resolve_settings(
        {"regex": pattern, "temperature": 1.2, "seed": 3, "max_new_tokens": 20}))
    assert regex.reason == "eos" and re.fullmatch(pattern, regex.text), regex.text
    ebnf = 'root ::= "(" num ("," num)? ")"\nnum ::= [1-9] [0-9]?'
    [out] = generate.generate(builtin, [ids], resolve_settings(
        {"grammar": ebnf, "max_new_tokens": 30}))
    assert out.reason == "eos" and re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)?\)", out.text)


def test_beam_search_hypotheses_follow_the_schema(builtin):
    settings = resolve_settings({"json_schema": SCHEMA, "strategy": "beam", "num_beams": 3,
                                 "num_return_sequences": 3, "max_new_tokens": 48})
    [result] = beam_search(builtin, [builtin.encode(PROMPT)], settings)
    assert result.hypotheses
    for hyp in result.hypotheses:
        assert hyp.finish_reason == "eos" and is_valid(hyp.text), hyp.text


@pytest.mark.parametrize("drafter", ["lookup", "model", "lookup first"])
def test_speculative_output_equals_plain_constrained_output(builtin, drafter):
    """Greedy speculation under a schema gives the plain constrained tokens; prompt
    lookup copies the prompt's JSON, whose keys the schema forbids, so drafts get cut
    (lookup first too); each drafter asked for proposes something the target verifies."""
    prompt = 'x = {"title": "abc", "ok": true, "n": 5}\ny = '
    ids = builtin.encode(prompt)
    settings = resolve_settings({"json_schema": SCHEMA, "max_new_tokens": 40})
    [plain] = generate.generate(builtin, [ids], settings)
    draft = load_model(ModelSpec(str(DEFAULT_DRAFT)))
    kwargs = {"lookup": {"prompt_lookup": 2, "num_draft_tokens": 6},
              "model": {"draft_lm": draft},
              "lookup first": {"prompt_lookup": 2, "draft_lm": draft}}[drafter]
    events = list(speculative_stream(builtin, ids, settings, **kwargs))
    finish = events[-1]
    assert finish.token_ids == plain.token_ids and finish.reason == plain.reason == "eos"
    assert is_valid(finish.text)
    verifies = [e for e in events if isinstance(e, Verify)]
    looked_up = [v for v in verifies if v.proposed and not v.draft_forwards]
    modelled = [v for v in verifies if v.draft_forwards]
    # each drafter asked for proposed something that reached the verify
    assert bool(looked_up) == ("lookup" in drafter), (drafter, verifies)
    assert bool(modelled) == (drafter != "lookup"), (drafter, verifies)


def test_sampled_speculation_with_drafts_reaching_the_grammars_end_ends_valid(builtin):
    """A draft equal to the target has its drafts accepted up to the end token: after it
    the grammar allows nothing, so neither the drafter nor the verify may draw there
    (both raised 'cannot draw from these weights (sum nan)')."""
    ids = builtin.encode(PROMPT)
    draft = load_model(ModelSpec(str(DEFAULT_MODEL)))
    for seed in range(4):
        settings = resolve_settings({"json_schema": SCHEMA, "temperature": 1.0, "seed": seed,
                                     "max_new_tokens": 48})
        finish = list(speculative_stream(builtin, ids, settings, draft_lm=draft))[-1]
        assert finish.reason == "eos" and is_valid(finish.text), (seed, finish.text)


def test_drafts_are_cut_before_the_first_token_the_grammar_forbids(builtin):
    constraint = grammar.compile_for(builtin.tokenizer, builtin.vocab_size, builtin.eos_ids,
                                     resolve_settings({"json_schema": SCHEMA}))
    matchers = grammar.Matchers.start(constraint)
    good = builtin.tokenizer.encode('{"name', add_special_tokens=False)
    bad = builtin.tokenizer.encode('{"title', add_special_tokens=False)
    assert grammar.valid_prefix(matchers, [], good) == len(good)
    cut = grammar.valid_prefix(matchers, [], bad)
    assert cut < len(bad)
    assert not matchers.allows(tuple(bad[:cut]), bad[cut])


def test_grammar_stage_is_pure_and_masks_per_row(builtin):
    settings = resolve_settings({"regex": "(ab|cd)+"})
    constraint = grammar.compile_for(builtin.tokenizer, builtin.vocab_size, builtin.eos_ids,
                                     settings)
    [stage] = processors.build_processors(settings, prompt_width=1, constraint=constraint)
    assert stage.name == "grammar"
    a = builtin.tokenizer.encode("ab", add_special_tokens=False)
    rows = torch.tensor([[5, *a]])  # prompt [5], then "ab"
    logits = torch.zeros(1, builtin.vocab_size)
    first = stage(rows, logits)
    assert torch.equal(first, stage(rows, logits))  # again: the same mask
    allowed = torch.isfinite(first[0]).nonzero().flatten().tolist()
    texts = {builtin.tokenizer.decode([t]) for t in allowed if t not in builtin.eos_ids}
    assert texts and all(re.fullmatch(r"(ab|cd)*(a|c)?", t) for t in texts)
    assert any(t in builtin.eos_ids for t in allowed)  # "ab" is complete: the end may follow
    assert torch.equal(logits, torch.zeros(1, builtin.vocab_size))  # input untouched


def test_without_xgrammar_the_grammar_settings_fail_with_one_line(monkeypatch, builtin):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setattr(grammar, "_TOKENIZERS", type(grammar._TOKENIZERS)())
    monkeypatch.setattr(grammar, "_COMPILED", type(grammar._COMPILED)())
    with pytest.raises(ConfigError, match=r"need xgrammar: pip install 'genlab\[grammar\]'"):
        generate.generate(builtin, [builtin.encode("x")], resolve_settings({"regex": "a+"}))


# --- the CLI ------------------------------------------------------------------------

runner = CliRunner()


def test_cli_json_schema_from_stdin_file_and_errors(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    result = runner.invoke(app, ["generate", PROMPT, "--json-schema", str(path), "-n", "48",
                                 "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)["outputs"][0]  # the JSON contract (docs/output.md)
    assert record["finish_reason"] == "eos" and is_valid(record["text"])
    short = runner.invoke(app, ["generate", PROMPT, "--json-schema", str(path), "-n", "3"])
    assert short.exit_code == 1
    assert "NOT valid" in short.stderr and "raise --max-new-tokens" in short.stderr
    # the other commands print the same warning and exit 1 too, with or without --json
    for command in (["beam", "-k", "2"], ["speculate", "--prompt-lookup", "2"], ["explain"],
                    ["compare", "-p", "greedy"], ["compare", "--models",
                                                  f"{DEFAULT_MODEL},{DEFAULT_MODEL}"]):
        for machine in ([], ["--json"]):
            cut = runner.invoke(app, [*command, PROMPT, "--json-schema", str(path), "-n", "3",
                                      *machine])
            assert cut.exit_code == 1, (command, machine, cut.output)
            assert "NOT valid" in cut.stderr, (command, machine)
    missing = runner.invoke(app, ["generate", "x", "--grammar", str(tmp_path / "none.gbnf")])
    assert missing.exit_code == 2 and "--grammar: cannot read" in missing.stderr
    bad = runner.invoke(app, ["generate", "x", "--regex", "[a-"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: regex cannot be compiled")
    assert "Traceback" not in bad.output


def test_xgrammars_log_lines_become_one_genlab_warning_each(builtin, capfd):
    settings = resolve_settings({"json_schema": {"type": "string", "pattern": "a$b"}})
    with pytest.warns(GenlabWarning) as caught:
        grammar.compile_for(builtin.tokenizer, builtin.vocab_size, builtin.eos_ids, settings)
    # xgrammar logs this one three times, with the time and its C++ source path
    assert [str(w.message) for w in caught] == [
        "json_schema: xgrammar warns: Anchor '$' in the middle of regex is ignored: a$b"]
    assert ".cc:" not in capfd.readouterr().err


def test_without_a_temporary_file_nothing_is_captured_and_stderr_stays(monkeypatch,
                                                                        capfd):
    """An unwritable TMPDIR: the compile's log goes to stderr as it comes, no warning is
    made of it, and descriptor 2 is what it was, no descriptor left open."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(grammar.tempfile, "TemporaryFile", refuse)
    before, open_fds = os.fstat(2), len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", GenlabWarning)
        with grammar._xgrammar_warnings("regex"):
            os.write(2, b"[09:00:00] /src/cpp/x.cc:12: Warning: first\n")
    assert capfd.readouterr().err == "[09:00:00] /src/cpp/x.cc:12: Warning: first\n"
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert len(os.listdir("/proc/self/fd")) == open_fds


def test_what_else_reaches_stderr_while_compiling_is_passed_on(capfd):
    with pytest.warns(GenlabWarning) as caught:
        with grammar._xgrammar_warnings("regex"):
            os.write(2, b"[09:00:00] /src/cpp/x.cc:12: Warning: first\r\n")
            os.write(2, b"someone else's line\n")
            os.write(2, b"[09:00:01] /src/cpp/x.cc:12: Warning: first\n")
            os.write(2, b"[09:00:01] /src/cpp/y.h:3: Warning: second\n")
    assert [str(w.message) for w in caught] == ["regex: xgrammar warns: first",
                                                "regex: xgrammar warns: second"]
    assert capfd.readouterr().err == "someone else's line\n"


def test_cli_shows_xgrammars_warnings_as_its_own_warning_lines():
    result = runner.invoke(app, ["generate", "x", "--regex", "a$b", "-n", "3"])
    assert result.exit_code == 0, result.output
    assert ("warning: regex: xgrammar warns: Regex parsing warning at position 2: '$' "
            "should be at the end of the regex, but found in the middle. It is ignored."
            ) in result.stderr
    assert "GenlabWarning" not in result.stderr and ".cc:" not in result.stderr
    assert result.stderr.count("xgrammar warns") == 1
    # compiled twice (greedy's chain, beam's): said once
    both = runner.invoke(app, ["compare", "x", "--regex", "a$b", "-n", "3", "-p", "greedy",
                               "--variant", "strategy=beam"])
    assert both.stderr.count("xgrammar warns") == 1, both.stderr


def test_cli_an_invalid_branch_or_a_second_budget_is_warned_and_exits_1():
    # explain: the original ends "1" (valid), the branch forced to "2" is cut at "234"
    args = ["explain", "x = ", "--regex", "(1|2345678)", "-n", "3", "--json"]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 0 and "NOT valid" not in plain.stderr
    from tests.test_explain import builtin_token_id

    branch = runner.invoke(app, [*args, "--branch", f"0:#{builtin_token_id('2')}"])
    assert json.loads(branch.stdout)["branch"]["finish_reason"] == "grammar_incomplete"
    assert branch.exit_code == 1 and "an output ended before" in branch.stderr
    # compare: a warning per max_new_tokens budget, each naming its own
    both = runner.invoke(app, ["compare", "x = ", "--regex", "[0-9]{20}", "-n", "3", "-p",
                               "greedy", "--variant", "max_new_tokens=4"])
    assert both.exit_code == 1
    warned = [line for line in both.stderr.splitlines() if "NOT valid" in line]
    assert len(warned) == 2 and "max_new_tokens 3" in warned[0], warned
    assert "max_new_tokens 4" in warned[1]


def test_cli_schema_or_grammar_text_where_a_file_goes_says_how_to_give_it():
    schema = runner.invoke(app, ["generate", "x", "--json-schema", '{"type": "object"}'])
    assert schema.exit_code == 2 and schema.stderr.strip() == (
        "error: --json-schema takes a file name or - (stdin), not the text itself: put it "
        "in a file, or pipe it in and give --json-schema -")
    text = runner.invoke(app, ["generate", "x", "--grammar", 'root ::= "a"'])
    assert text.exit_code == 2 and "--grammar takes a file name or - (stdin)" in text.stderr
    empty = runner.invoke(app, ["generate", "x", "--grammar", ""])
    assert empty.exit_code == 2
    assert empty.stderr.strip() == "error: --grammar needs a file name, or - for stdin"
    usage = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "250"}).stdout
    # Typer fixes its help's width when first imported (TERMINAL_WIDTH), so the help may
    # wrap whatever COLUMNS says here: read it with the panel's borders and breaks gone.
    flat = " ".join(usage.replace("│", " ").split())
    assert re.search(r"--grammar FILE\|- Constrain .*\(`-` = stdin", flat)


def test_batch_lines_carry_their_own_json_schema(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(line) for line in [
        {"id": "a", "prompt": PROMPT, "json_schema": SCHEMA},
        {"id": "b", "prompt": "x = ", "regex": "[0-9]{3}"},
        {"id": "c", "prompt": "x = ", "json_schema": {"type": "nonsense"}},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    result = runner.invoke(app, ["generate", "--input", str(src), "--output", str(out),
                                 "-n", "48"])
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert is_valid(records["a"]["text"]) and records["a"]["finish_reason"] == "eos"
    assert re.fullmatch("[0-9]{3}", records["b"]["text"])
    assert "not a valid JSON schema" in records["c"]["error"]
    assert "Traceback" not in result.output


def test_compare_columns_all_follow_the_grammar(tmp_path):
    result = runner.invoke(app, ["compare", "x = ", "--regex", "[0-9]{2}", "-n", "8",
                                 "-p", "greedy", "--variant", "temperature=1.5", "--seed", "1",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    samples = [x for strategy in data["strategies"] for x in strategy["outputs"]]
    assert len(samples) == 2
    for sample in samples:
        assert sample["finish_reason"] == "eos" and re.fullmatch("[0-9]{2}", sample["text"])


@pytest.mark.slow
def test_interactive_session_keeps_the_grammar_for_every_turn(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    import os

    from tests.conftest import ROOT, STORIES

    env = {**os.environ, "GENLAB_HISTORY": str(tmp_path / "history"), "NO_COLOR": "1",
           "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "cli", "generate", "-i", "-m", str(STORIES),
                                           "--regex", "(yes|no)", "-n", "8"], cwd=str(ROOT),
                          env=env, encoding="utf-8", timeout=60, dimensions=(40, 200))
    for prompt in ("Once upon a time", "Was the dog happy?"):
        child.expect_exact("genlab> ")
        child.sendline(prompt)
        child.expect(r"\r\n(yes|no)\r\n")
        child.expect_exact("finish: eos")
    child.sendline("/set regex=[0-9]{3}")
    child.expect_exact("genlab> ")
    child.sendline("Count to three")
    child.expect(r"\r\n[0-9]{3}\r\n")
    child.expect_exact("genlab> ")
    child.sendeof()
    child.expect(pexpect.EOF)


def test_matchers_moved_in_place_are_rebuilt_exactly_for_beams_and_rollbacks(builtin):
    """A matcher advanced in place (the common step) must still give its old key's state
    when a second beam or a speculative rollback asks for it: same mask as a replay."""
    import xgrammar as xgr

    constraint = grammar.compile_for(builtin.tokenizer, builtin.vocab_size, builtin.eos_ids,
                                     resolve_settings({"json_schema": SCHEMA}))
    text = builtin.tokenizer.encode('{"name": "ab", "ok": true', add_special_tokens=False)
    matchers = grammar.Matchers.start(constraint)
    for n in range(1, len(text) + 1):  # step by step, as decoding asks
        assert matchers.get(tuple(text[:n])) is not None
    alt = builtin.tokenizer.encode('{"name": "ab", "ok": false', add_special_tokens=False)
    common = next(i for i, (x, y) in enumerate(zip(text, alt)) if x != y)

    def mask(m) -> torch.Tensor:
        bitmask = xgr.allocate_token_bitmask(1, builtin.vocab_size)
        m.fill_next_token_bitmask(bitmask, 0)
        return bitmask

    def replay(key) -> torch.Tensor:
        fresh = xgr.GrammarMatcher(constraint.grammar)
        assert all(fresh.accept_token(t) for t in key)
        return mask(fresh)

    for key in (tuple(text[:3]), tuple(text[:common]), tuple(alt), tuple(text)):
        matcher = matchers.get(key)
        assert matcher is not None and torch.equal(mask(matcher), replay(key)), key
    bad = builtin.tokenizer.encode("}", add_special_tokens=False)[0]
    assert matchers.get((*text[:2], bad)) is None  # '{"' then '}' is not JSON
    assert torch.equal(mask(matchers.get(tuple(text[:2]))), replay(text[:2]))
