"""The JSON contract (docs/output.md): every command's --json document and --jsonl lines
validate against docs/output.schema.json, and name the same facts alike."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import ROOT, STORIES

SCHEMA = json.loads((ROOT / "docs" / "output.schema.json").read_text())
VALIDATOR = Draft202012Validator(SCHEMA)
PROMPT = "Once upon a time"
M = ["-m", str(STORIES)]

COMMANDS = {
    "generate": ["generate", PROMPT, *M, "-n", "5", "-t", "0.8", "--seed", "1",
                 "--num-return-sequences", "2"],
    "beam": ["beam", PROMPT, *M, "-n", "5", "-k", "2"],
    "speculate": ["speculate", PROMPT, *M, "-n", "6", "--prompt-lookup", "2"],
    "compare": ["compare", PROMPT, *M, "-n", "5", "-p", "greedy", "--variant", "top_k=5",
                "--samples", "2", "--seed", "2", "--logprobs", "2"],
    "compare-models": ["compare", PROMPT, "--models", f"{STORIES},{STORIES}", "-n", "4"],
    "bench": ["bench", *M, "--runs", "1", "--warmup", "0", "--prompt-len", "4",
              "--new-tokens", "3", "--no-bandwidth", "-p", "creative"],
}
# Commands whose documents these tests check (explain's --jsonl has a test of its own).
DOCUMENTS = {
    **COMMANDS,
    "explain": ["explain", PROMPT, *M, "-n", "4", "-t", "0.8", "--seed", "1", "--top", "3",
                "--branch", "1:#370"],
}


def run(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def errors(obj) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in VALIDATOR.iter_errors(obj)]


@pytest.fixture(scope="module")
def documents():
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    return {name: json.loads(run(*args, "--json").stdout) for name, args in DOCUMENTS.items()}


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_every_document_validates(documents, name):
    doc = documents[name]
    assert errors(doc) == []
    assert doc["command"] == name.split("-")[0]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_jsonl_line_validates_and_matches_the_document(documents, name):
    lines = [json.loads(line) for line in run(*COMMANDS[name], "--jsonl").stdout.splitlines()]
    assert lines
    for line in lines:
        assert errors(line) == []
    doc = documents[name]
    texts = [o["text"] for o in outputs_of(doc)]
    if name == "bench":
        assert len(lines) == len(doc["results"])
    elif name == "beam":  # the hypotheses, then the greedy contrast
        assert [x["text"] for x in lines] == [*texts, doc["greedy"]["text"]]
        assert [x["role"] for x in lines] == ["beam"] * len(texts) + ["greedy"]
    else:  # the same seeds: the same texts, in the same order
        assert [x["text"] for x in lines] == texts


CHAT = ["-m", "builtin:code-small", "--chat", "--system", "Answer in code.", "-n", "3"]


@pytest.mark.parametrize("command", ["generate", "beam", "speculate", "explain"])
def test_a_chat_prompt_names_its_messages_in_each_document_and_line(command):
    """--chat's documents and lines say what the chat template was applied to, in the
    order the template took them; without --chat there are none."""
    extra = ["--prompt-lookup", "2"] if command == "speculate" else []
    want = [{"role": "system", "content": "Answer in code."},
            {"role": "user", "content": "def add(a, b):"}]
    doc = json.loads(run(command, "def add(a, b):", *CHAT, *extra, "--json").stdout)
    assert errors(doc) == [] and doc["messages"] == want
    assert list(doc).index("messages") == list(doc).index("prompt") + 1
    lines = [json.loads(line) for line in
             run(command, "def add(a, b):", *CHAT, *extra, "--jsonl").stdout.splitlines()]
    assert lines and all(errors(line) == [] and line["messages"] == want for line in lines)
    plain = json.loads(run(command, "def add(a, b):", "-m", "builtin:code-small", "-n", "3",
                           *extra, "--json").stdout)
    assert "messages" not in plain and plain["prompt_tokens"] < doc["prompt_tokens"]


def outputs_of(doc):
    if doc["command"] == "compare":
        groups = doc.get("strategies") or doc.get("runs")
        return [o for group in groups for o in group["outputs"]]
    return doc.get("outputs", [])


def test_shared_facts_are_named_alike(documents):
    """prompt_tokens everywhere a prompt ran, indices from 1, timings' four keys."""
    for name in ("generate", "beam", "speculate", "compare"):
        assert documents[name]["prompt_tokens"] == 5, name  # BOS + "Once upon a time"
        outs = outputs_of(documents[name])
        assert outs, name
        for out in outs:
            assert set(out["timings"]) == {"prefill_s", "ttft_s", "total_s", "tokens_per_s"}
            assert out["new_tokens"] == len(out["token_ids"])
    for result in documents["bench"]["results"]:  # bench measures prefill: it says so
        timings = result["timings"]
        assert timings["prefill_s"] == pytest.approx(result["prefill_s"], abs=1e-6), timings
        assert 0 < timings["prefill_s"] <= timings["ttft_s"] <= timings["total_s"], timings
    assert [o["index"] for o in documents["generate"]["outputs"]] == [1, 2]
    assert [o["index"] for o in documents["beam"]["outputs"]] == [1, 2]  # as the table
    assert documents["generate"]["model"] == documents["explain"]["model"] == str(STORIES)
    assert documents["explain"]["prompt_tokens"] == 5  # explain's runs are not outputs
    assert documents["bench"]["results"][0]["settings"]["strategy"] == "sample"  # creative


def test_every_run_names_the_backend_that_ran(documents):
    """generate, beam and speculate say which backend ran and why; bench's every row."""
    from genlib.backends import kernel

    expected = "native" if kernel.build().library is not None else None
    for name in ("generate", "beam", "speculate"):
        backend = documents[name]["backend"]
        assert backend["reason"], name
        assert backend["architecture"] == "llama", name  # stories260K's
        if expected:
            assert backend["name"] == expected, name
    rows = documents["bench"]["results"]
    assert [r["backend_requested"] for r in rows] == ["auto"]
    assert all(r["backend"] in ("native", "lean", "transformers") for r in rows)
    assert all(r["architecture"] == "llama" for r in rows)
    doc = json.loads(json.dumps(documents["generate"]))
    doc["backend"]["name"] = "warp"
    assert errors(doc)


def test_the_schema_rejects_what_breaks_the_contract(documents):
    doc = json.loads(json.dumps(documents["beam"]))
    doc["outputs"][0]["index"] = 0  # the old 0-based rank
    assert errors(doc)
    doc = json.loads(json.dumps(documents["speculate"]))
    del doc["prompt_tokens"]
    assert errors(doc)
    doc = json.loads(json.dumps(documents["generate"]))
    doc["outputs"][0]["timings"]["seconds"] = 1.0  # a name outside the contract
    assert errors(doc)


def test_logprobs_is_the_openai_object_and_token_logprobs_the_raw_list(documents):
    """Schema 2: `logprobs` has one meaning, the object --logprobs N adds (compare's here,
    as generate's); the raw per-token list is `token_logprobs` (beam, compare)."""
    for out in outputs_of(documents["compare"]):
        content = out["logprobs"]["content"]
        assert [e["id"] for e in content] == out["token_ids"]
        assert [e["logprob"] for e in content] == out["token_logprobs"]
        assert all(len(e["top_logprobs"]) == 2 for e in content)
    for out in documents["beam"]["outputs"]:
        assert "logprobs" not in out and len(out["token_logprobs"]) == out["new_tokens"]
    assert {documents[name]["schema_version"] for name in COMMANDS} == {2}
    doc = json.loads(json.dumps(documents["compare"]))
    out = doc["strategies"][0]["outputs"][0]
    out["logprobs"] = out["token_logprobs"]  # the version 1 meaning
    assert errors(doc)
    out["logprobs"] = {"content": [{"token": "x", "logprob": -1.0}]}  # keys missing
    assert errors(doc)


def test_output_file_gets_the_document_and_stdout_stays_empty(tmp_path):
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    target = tmp_path / "out.json"
    result = run("generate", PROMPT, *M, "-n", "4", "--json", "-o", str(target))
    assert result.stdout == ""
    doc = json.loads(target.read_text())
    assert errors(doc) == [] and doc["outputs"][0]["text"].startswith(", there")


# -o FILE: what stdout would get, in FILE; (command line, whether two runs print the same)
TO_FILE = {
    "generate": (["generate", PROMPT, *M, "-n", "5"], True),
    "beam": (["beam", PROMPT, *M, "-n", "5", "-k", "2"], True),
    "speculate": (["speculate", PROMPT, *M, "-n", "5", "--prompt-lookup", "2",
                   "--no-baseline"], True),
    "explain": (["explain", PROMPT, *M, "-n", "3", "-t", "0.8", "--seed", "1"], True),
    "compare": (["compare", PROMPT, *M, "-n", "5", "-p", "greedy"], False),  # timings
    "bench": ([*COMMANDS["bench"]], False),
    "presets list": (["presets", "list"], True),
    "presets show": (["presets", "show", "creative"], True),
    "presets keys": (["presets", "keys"], True),
}


@pytest.mark.parametrize("name", list(TO_FILE))
def test_output_file_gets_what_stdout_would_and_nothing_else_moves(tmp_path, name):
    """-o FILE means one thing on every command: FILE gets what stdout would have got
    (here the text view, as a pipe gets it), stdout gets nothing, and stderr only its
    usual lines: the text is not echoed there."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    args, same = TO_FILE[name]
    plain = run(*args)
    target = tmp_path / "out.txt"
    filed = run(*args, "-o", str(target))
    assert filed.stdout == ""
    written = target.read_text()
    assert written.strip()
    if same:
        assert written == plain.stdout
        assert len(filed.stderr.splitlines()) == len(plain.stderr.splitlines())  # timings vary
    else:
        assert written.splitlines()[0] == plain.stdout.splitlines()[0]
    for line in written.splitlines():
        assert line.strip() == "" or line not in filed.stderr


@pytest.mark.parametrize("form", ["--json", "--jsonl"])
def test_output_file_gets_the_json_stdout_would(tmp_path, form):
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    args = ["compare", PROMPT, *M, "-n", "4", "-p", "greedy", form]
    target = tmp_path / "out.json"
    assert run(*args, "-o", str(target)).stdout == ""
    docs = [json.loads(line) for line in target.read_text().splitlines()] \
        if form == "--jsonl" else [json.loads(target.read_text())]
    assert docs and all(errors(doc) == [] for doc in docs)


def test_output_file_lays_several_outputs_out_as_stdout_does(tmp_path):
    """generate -o FILE holds what stdout would: with --num-return-sequences, each
    output on its lines and a blank line between them (not run together)."""
    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    sampled = ["generate", PROMPT, *M, "-n", "6", "-t", "1", "--seed", "3",
               "--num-return-sequences", "3", "--stop", "."]
    target = tmp_path / "out.txt"
    shown = run(*sampled).stdout
    assert run(*sampled, "-o", str(target)).stdout == ""
    assert target.read_text() == shown
    texts = [o["text"] for o in json.loads(run(*sampled, "--json").stdout)["outputs"]]
    assert shown == "\n\n".join(texts) + "\n"


@pytest.mark.parametrize("command", ["generate", "beam", "speculate", "compare", "bench"])
def test_json_and_jsonl_together_are_refused(command):
    result = CliRunner().invoke(app, [command, *([PROMPT] if command != "bench" else []),
                                      "--json", "--jsonl"])
    assert result.exit_code == 2
    assert "--json and --jsonl exclude each other" in result.stderr


# --- explain ----------------------------------------------------------------------------

def test_explain_document_holds_both_runs_step_by_step(documents):
    doc = documents["explain"]
    assert doc["sampler"] == "inverse_cdf" and doc["settings"]["temperature"] == 0.8
    original, branch = doc["original"], doc["branch"]
    assert original["text"] == ", there was a" and original["finish_reason"] == "length"
    assert [s["token"] for s in original["steps"]] == [",", " there", " was", " a"]
    assert original["token_ids"] == [s["chosen"]["id"] for s in original["steps"]]
    assert (branch["step"], branch["token_id"], branch["diverges_at"]) == (1, 370, 1)
    assert branch["token_ids"][:2] == [432, 370]
    assert [s["forced"] for s in branch["steps"]] == [False, True, False, False]
    for step in original["steps"]:
        assert [s["name"] for s in step["stages"]] == ["raw", "temperature"]
        assert len(step["candidates"]) == 3  # --top 3


def test_the_schema_rejects_a_broken_explain_document(documents):
    doc = json.loads(json.dumps(documents["explain"]))
    del doc["original"]["steps"][0]["draw"]
    assert errors(doc)
    doc = json.loads(json.dumps(documents["explain"]))
    doc["original"]["steps"][0]["chosen"]["stage_probs"]["raw"] = 1.5  # not a probability
    assert errors(doc)
    doc = json.loads(json.dumps(documents["explain"]))
    doc["sampler"] = "multinomial"
    assert errors(doc)


def test_explain_jsonl_is_the_documents_steps_one_a_line(documents):
    """explain --jsonl: the original's steps, then the branch's, each the document's step
    object with `run` and the run's facts beside it; every line validates."""
    doc = documents["explain"]
    lines = [json.loads(line)
             for line in run(*DOCUMENTS["explain"], "--jsonl").stdout.splitlines()]
    assert [errors(line) for line in lines] == [[]] * len(lines)
    steps = [("original", s) for s in doc["original"]["steps"]] + \
        [("branch", s) for s in doc["branch"]["steps"]]
    assert len(lines) == len(steps) == 8
    for line, (name, step) in zip(lines, steps, strict=True):
        assert line["run"] == name
        assert {key: line[key] for key in step} == step
        assert line["prompt"] == PROMPT and line["settings"] == doc["settings"]
    broken = dict(lines[0], run="other")
    assert errors(broken)
    del broken["run"]
    assert errors(broken)


# --- presets ----------------------------------------------------------------------------

PRESETS = {"presets list": ["presets", "list"], "presets show": ["presets", "show", "warm"],
           "presets keys": ["presets", "keys"]}


@pytest.fixture
def user_presets(tmp_path, monkeypatch):
    """A presets folder with a preset that extends a built-in and one that is broken."""
    folder = tmp_path / "presets"
    folder.mkdir()
    monkeypatch.setenv("GENLAB_PRESETS_DIR", str(folder))
    (folder / "warm.yaml").write_text(
        "name: warm\ndescription: creative, warmer\nextends: creative\ntemperature: 1.2\n"
        "model: ../shared/models/stories260K\n")
    (folder / "broken.yaml").write_text("temprature: 0.7\n")
    return folder.resolve()


@pytest.mark.parametrize("command", list(PRESETS))
def test_every_presets_document_validates(user_presets, command):
    doc = json.loads(run(*PRESETS[command], "--json").stdout)
    assert errors(doc) == []
    assert doc["command"] == command


def test_presets_list_document(user_presets):
    from genlib.settings.presets import builtin_dir

    doc = json.loads(run("presets", "list", "--json").stdout)
    rows = {row["name"]: row for row in doc["presets"]}
    assert {"greedy", "creative", "precise", "topk", "beam", "llamacpp", "warm",
            "broken"} <= set(rows)
    assert rows["creative"] == {
        "name": "creative", "strategy": "sample", "model": None, "source": "built-in",
        "description": "Nucleus (top-p) sampling at a warm temperature, for varied "
                       "open-ended text.",
        "path": str(builtin_dir().resolve() / "creative.yaml"), "error": None}
    assert rows["beam"]["strategy"] == "beam" and rows["greedy"]["strategy"] == "greedy"
    warm = rows["warm"]
    assert (warm["source"], warm["strategy"], warm["model"], warm["path"]) == (
        "user", "sample", "../shared/models/stories260K", str(user_presets / "warm.yaml"))
    broken = rows["broken"]
    assert "'temprature'" in broken["error"] and broken["strategy"] is None
    assert doc["user_dir"] == str(user_presets) and doc["model"] is None


def test_presets_show_document_says_where_each_setting_came_from(user_presets):
    from genlib.settings.presets import builtin_dir

    doc = json.loads(run("presets", "show", "warm", "--json").stdout)
    assert doc["model"] == "../shared/models/stories260K"
    assert doc["preset"] == {"name": "warm", "description": "creative, warmer",
                             "source": "user", "path": str(user_presets / "warm.yaml")}
    settings = doc["settings"]
    assert (settings["temperature"], settings["top_p"], settings["strategy"]) == (
        1.2, 0.92, "sample")
    assert settings["top_k"] == 0 and settings["seed"] is None  # genlab's defaults
    creative = str(builtin_dir().resolve() / "creative.yaml")
    assert doc["set_by"] == {"strategy": creative, "top_p": creative,
                             "max_new_tokens": creative,
                             "temperature": str(user_presets / "warm.yaml")}


def test_presets_show_by_path_is_a_file(user_presets, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("top_k: 7\n")
    doc = json.loads(run("presets", "show", str(path), "--json").stdout)
    assert errors(doc) == []
    assert doc["preset"]["source"] == "file" and doc["preset"]["name"] == "mine"
    assert doc["model"] is None and doc["settings"]["top_k"] == 7
    assert doc["settings"]["strategy"] == "sample"  # top_k > 0 implies sampling
    assert doc["set_by"] == {"top_k": str(path.resolve())}


def test_presets_keys_document_lists_every_setting(user_presets):
    from genlib.settings.config import SPECS

    doc = json.loads(run("presets", "keys", "--json").stdout)
    keys = {key["key"]: key for key in doc["keys"]}
    assert list(keys) == list(SPECS)
    assert keys["top_p"] == {"key": "top_p", "type": "float", "default": 1.0,
                             "nullable": False, "allowed": "0 < top_p <= 1", "choices": [],
                             "meaning": SPECS["top_p"].help}
    assert keys["strategy"]["choices"] == ["greedy", "sample", "beam"]
    assert keys["strategy"]["default"] is None and keys["strategy"]["nullable"] is True
    assert keys["max_new_tokens"]["default"] == 128
    assert keys["dry_sequence_breakers"]["default"] == ["\n", ":", "\"", "*"]
    assert keys["logit_bias"]["default"] == {}  # as `settings` holds it


def test_the_schema_rejects_broken_presets_documents(user_presets):
    doc = json.loads(run("presets", "list", "--json").stdout)
    doc["presets"][0]["source"] = "somewhere"
    assert errors(doc)
    doc = json.loads(run("presets", "show", "creative", "--json").stdout)
    del doc["settings"]["strategy"]
    assert errors(doc)
    doc = json.loads(run("presets", "keys", "--json").stdout)
    doc["keys"][0]["type"] = "number"
    assert errors(doc)


def test_presets_output_file(user_presets, tmp_path):
    target = tmp_path / "keys.json"
    assert run("presets", "keys", "--json", "-o", str(target)).stdout == ""
    assert errors(json.loads(target.read_text())) == []
    shown = tmp_path / "creative.yaml"  # without --json, show writes its YAML there
    assert run("presets", "show", "creative", "-o", str(shown)).stdout == ""
    assert "top_p: 0.92" in shown.read_text().splitlines()
    listed = tmp_path / "list.txt"  # and list its table, as a pipe gets it
    assert run("presets", "list", "-o", str(listed)).stdout == ""
    assert "warm" in listed.read_text() and "\x1b[" not in listed.read_text()


# --- every command --------------------------------------------------------------------

def leaf_commands(command, prefix=()):
    """(name, its option strings) of every command the user can run, subcommands too."""
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from leaf_commands(sub, (*prefix, name))
    else:
        yield " ".join(prefix), {o for p in command.params for o in getattr(p, "opts", ())}


def test_every_command_takes_json_and_its_document_is_validated_here():
    import typer.main

    commands = dict(leaf_commands(typer.main.get_command(app)))
    assert {name for name, opts in commands.items() if "--json" not in opts} == set()
    assert {name for name, opts in commands.items() if "-o" not in opts} == set()
    validated = {args[0] for args in DOCUMENTS.values()} | set(PRESETS) | set(CACHE) | \
        set(DAEMON)
    assert set(commands) == validated


def test_speculate_reports_the_schedule_that_ran(documents):
    doc = documents["speculate"]  # prompt lookup: a fixed gamma of 10 unless asked
    assert doc["adaptive"] is False and doc["num_draft_tokens"] == 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a pseudo-terminal")
def test_output_file_takes_the_view_without_the_terminals_colours(tmp_path):
    """stdout and stderr terminals, -o FILE: beam's table goes to the file without the
    escape codes the terminal would have had, and neither terminal shows it."""
    import pty
    import subprocess

    if not STORIES.is_dir():
        pytest.skip("stories260K not present")
    leader, follower = pty.openpty()
    table = tmp_path / "b.txt"
    done = subprocess.run([sys.executable, "-m", "cli", "beam", PROMPT, *M, "-n", "3",
                           "-k", "2", "-o", str(table)], stdout=follower, stderr=follower,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert done.returncode == 0
    assert ", there was" in table.read_text() and "\x1b[" not in table.read_text()
    assert b", there was" not in shown


def test_a_run_stopped_before_any_backend_ran_is_still_a_valid_document(monkeypatch):
    """Ctrl-C (or SIGTERM) during the prompt's prefill: no backend has run, and the
    document said "backend": null, which its schema refuses; the key is now left out."""
    from genlib.backends.base import Backend

    def interrupted(self, rows, capacity):
        raise KeyboardInterrupt

    monkeypatch.setattr(Backend, "prefill", interrupted)
    result = CliRunner().invoke(app, ["generate", "Once", "-m", str(STORIES), "-n", "4",
                                      "--json"])
    assert result.exit_code == 130, result.output
    doc = json.loads(result.stdout)
    assert "backend" not in doc
    VALIDATOR.validate(doc)


# --- cache -------------------------------------------------------------------------------

CACHE = {"cache list": ["cache", "list"], "cache clear": ["cache", "clear"]}
# Validated with a daemon running in tests/test_daemon.py, and without one here.
DAEMON = {"daemon start": ["daemon", "start"], "daemon stop": ["daemon", "stop"],
          "daemon status": ["daemon", "status"]}


def test_daemon_documents_without_a_daemon_validate(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    stopped = json.loads(run(*DAEMON["daemon stop"], "--json").stdout)
    assert errors(stopped) == [] and (stopped["pid"], stopped["still_running"]) == (None, 0)
    result = CliRunner().invoke(app, [*DAEMON["daemon status"], "--json"])
    assert result.exit_code == 3
    status = json.loads(result.stdout)
    assert errors(status) == [] and status["daemon"] is None
    assert status["socket"].startswith(str(tmp_path / "genlab" / "daemon-"))


def test_cache_documents_validate_and_say_what_the_cache_held(tmp_path, monkeypatch):
    """`cache list --json` lists each packed-weights entry, tokenizer and kernel build
    with its size, and `cache clear --json` says what it freed; both validate against the
    schema, and -o FILE gets the document instead of stdout."""
    from transformers import AutoTokenizer

    from genlib.backends import weightcache
    from genlib.models import tokenizer_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"weights")
    stat = model.stat()
    key = {"file": str(model), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
           "weights": "q8_0"}
    weightcache.cached("m-q8_0", key, lambda: {"codes": torch.zeros(100, dtype=torch.uint8)})
    native = tmp_path / "genlab" / "native"
    native.mkdir()
    (native / "lean_step-abc.so").write_bytes(bytes(1000))
    if STORIES.is_dir():
        tokenizer_cache.cached_tokenizer(STORIES, lambda: AutoTokenizer.from_pretrained(STORIES))
    listed = json.loads(run(*CACHE["cache list"], "--json").stdout)
    assert errors(listed) == [] and listed["command"] == "cache list"
    entry = (tmp_path / "genlab" / "weights" / "m-q8_0.weights").stat().st_size
    kept = [p.stat().st_size for p in (tmp_path / "genlab" / "tokenizers").glob("*")] \
        if STORIES.is_dir() else []
    assert [(e["kind"], e["name"], e["format"], e["size"], e["stale"])
            for e in listed["entries"]] == [
        ("weights", str(model), "q8_0", entry, False),
        *[("tokenizer", str(STORIES), None, size, False) for size in kept],
        ("kernel", "lean_step-abc.so", None, 1000, None)]
    assert listed["total_bytes"] == entry + sum(kept) + 1000
    target = tmp_path / "cleared.json"
    assert run(*CACHE["cache clear"], "--json", "-o", str(target)).stdout == ""
    cleared = json.loads(target.read_text())
    assert errors(cleared) == [] and cleared["command"] == "cache clear"
    assert (cleared["freed_bytes"], cleared["files"]) == (entry + sum(kept) + 1000,
                                                          2 + len(kept))
    assert json.loads(run(*CACHE["cache list"], "--json").stdout)["entries"] == []
