"""The JSON contract (docs/output.md): every command's --json document and --jsonl lines
validate against docs/output.schema.json, and name the same facts alike."""

from __future__ import annotations

import json

import pytest
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
    return {name: json.loads(run(*args, "--json").stdout) for name, args in COMMANDS.items()}


@pytest.mark.parametrize("name", list(COMMANDS))
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
    assert [o["index"] for o in documents["generate"]["outputs"]] == [1, 2]
    assert [o["index"] for o in documents["beam"]["outputs"]] == [1, 2]  # as the table
    assert documents["generate"]["model"] == str(STORIES)
    assert documents["bench"]["results"][0]["settings"]["strategy"] == "sample"  # creative


def test_every_run_names_the_backend_that_ran(documents):
    """generate, beam and speculate say which backend ran and why; bench's every row."""
    from genlib.backends import kernel

    expected = "native" if kernel.build().library is not None else None
    for name in ("generate", "beam", "speculate"):
        backend = documents[name]["backend"]
        assert backend["reason"], name
        if expected:
            assert backend["name"] == expected, name
    rows = documents["bench"]["results"]
    assert [r["backend_requested"] for r in rows] == ["auto"]
    assert all(r["backend"] in ("native", "lean", "transformers") for r in rows)
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


@pytest.mark.parametrize("command", ["generate", "beam", "speculate", "compare", "bench"])
def test_json_and_jsonl_together_are_refused(command):
    result = CliRunner().invoke(app, [command, *([PROMPT] if command != "bench" else []),
                                      "--json", "--jsonl"])
    assert result.exit_code == 2
    assert "--json and --jsonl exclude each other" in result.stderr
