"""The generate and presets commands, through Typer's runner and a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import CODE_TARGET, LLAMA2XS, ROOT, STORIES, wait_for_lines

runner = CliRunner()
MODEL = ["-m", str(STORIES)]


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def test_generate_greedy_text_matches_the_golden_start():
    result = invoke("generate", "Once upon a time", *MODEL, "-n", "20")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(", there was a little girl named Lily.")
    assert "\x1b[" not in result.stdout  # not a terminal: no colour codes


def test_generate_reads_stdin_and_prints_json():
    result = invoke("generate", *MODEL, "-n", "12", "--json", "-t", "0.8", "--seed", "5",
                    input="Once upon a time\n")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (record,) = doc["outputs"]
    assert doc["prompt"] == "Once upon a time"
    assert record["new_tokens"] == 12 and record["finish_reason"] == "length"
    assert doc["settings"]["temperature"] == 0.8 and doc["settings"]["seed"] == 5
    assert doc["settings"]["strategy"] == "sample"
    assert {"ttft_s", "tokens_per_s", "prefill_s", "total_s"} <= set(record["timings"])
    again = invoke("generate", "-", *MODEL, "-n", "12", "--json", "-t", "0.8", "--seed", "5",
                   input="Once upon a time")
    assert json.loads(again.stdout)["outputs"][0]["text"] == record["text"]


def test_preset_and_flag_precedence_in_json():
    result = invoke("generate", "Once", *MODEL, "-p", "creative", "-t", "0.5", "-n", "5",
                    "--json", "--seed", "1")
    settings = json.loads(result.stdout)["settings"]
    assert settings["temperature"] == 0.5  # flag beats preset
    assert settings["top_p"] == 0.92  # from the preset


def test_num_return_sequences_prints_each_output():
    args = ["generate", "Once upon a time", *MODEL, "-n", "30", "-t", "1.0", "--seed", "2",
            "--json"]
    result = invoke(*args, "--num-return-sequences", "3")
    records = json.loads(result.stdout)["outputs"]  # one document, whatever the count
    assert [r["index"] for r in records] == [1, 2, 3]
    assert len({r["text"] for r in records}) == 3  # each row draws its own tokens
    single = json.loads(invoke(*args).stdout)["outputs"][0]
    assert single["token_ids"] == records[0]["token_ids"]  # row 0 uses --seed itself
    lines = [json.loads(line) for line in invoke(*args[:-1], "--jsonl",
                                                 "--num-return-sequences", "3"
                                                 ).stdout.splitlines()]
    assert [x["token_ids"] for x in lines] == [r["token_ids"] for r in records]


def test_stop_string_not_printed():
    result = invoke("generate", "Once upon a time", *MODEL, "-n", "40", "--stop", "Lily")
    assert result.exit_code == 0
    assert result.stdout == ", there was a little girl named \n"


def test_stats_go_to_stderr():
    result = invoke("generate", "Once", *MODEL, "-n", "5", "--stats")
    assert "tok/s" in result.stderr and "tok/s" not in result.stdout


@pytest.mark.parametrize("form", ["--json", "--jsonl"])
def test_stats_stay_on_stderr_beside_json(form):
    """--stats with --json or --jsonl: the figures on stderr, as without them, agreeing
    with the document's (stdout holds JSON only)."""
    result = invoke("generate", "Once upon a time", *MODEL, "-n", "12", "-t", "1", "--seed",
                    "2", "--num-return-sequences", "2", "--stop", "Lily", "--stats", form)
    assert result.exit_code == 0, result.output
    if form == "--json":
        outputs = json.loads(result.stdout)["outputs"]
    else:
        outputs = sorted((json.loads(x) for x in result.stdout.splitlines()),
                         key=lambda o: o["index"])
    stats = [x for x in result.stderr.splitlines() if "tok/s" in x]
    assert [(s.split(" tokens")[0], s.split("finish: ")[1].split(" ")[0]) for s in stats] == \
        [(str(o["new_tokens"]), o["finish_reason"]) for o in outputs]
    assert len(stats) == 2


def test_stats_start_their_own_line_after_the_streamed_text():
    both = subprocess.run([sys.executable, "-m", "cli", "generate", "Once upon a time", *MODEL,
                           "-n", "5", "--stats"], cwd=ROOT, capture_output=False, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert both.returncode == 0, both.stdout
    text, *stats = both.stdout.splitlines()  # the backend on a line of its own at 80
    assert text == ", there was a little" and stats[0].startswith("5 tokens · first token")


@pytest.mark.parametrize("width", ["80", "60"])
def test_stats_lines_fit_the_terminal(width):
    result = subprocess.run([sys.executable, "-m", "cli", "generate", "Once upon a time",
                             *MODEL, "-n", "5", "--stats"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "COLUMNS": width})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) >= 2 and all(len(line) <= int(width) for line in lines), lines
    assert lines[0].startswith("5 tokens · first token")
    assert any(line.startswith("backend ") for line in lines[1:]), lines


def test_one_token_has_no_decode_rate():
    """With one token there is no interval between tokens: --stats shows "-" for tok/s
    (the first-token time says how long it took), and the JSON null, not 0.0."""
    result = invoke("generate", "Once upon a time", *MODEL, "-n", "1", "--stats")
    assert result.exit_code == 0, result.output
    assert "1 tokens · first token " in result.stderr and " · - tok/s · " in result.stderr
    assert "0.0 tok/s" not in result.stderr
    doc = json.loads(invoke("generate", "Once upon a time", *MODEL, "-n", "1", "--json").stdout)
    assert doc["outputs"][0]["timings"]["tokens_per_s"] is None
    two = json.loads(invoke("generate", "Once upon a time", *MODEL, "-n", "2", "--json").stdout)
    assert two["outputs"][0]["timings"]["tokens_per_s"] > 0


@pytest.mark.parametrize("args,fragment", [
    (["generate", "x", "-m", "/nonexistent/model"], "does not exist"),
    (["generate", "x", *MODEL, "-t", "0"], "temperature must be > 0"),
    (["generate", "x", *MODEL, "--top-p", "2"], "0 < top_p <= 1"),
    (["generate", "x", *MODEL, "-p", "creativ"], "did you mean 'creative'"),
    (["generate", "x", *MODEL, "--quantize", "4bit", "--backend", "transformers"],
     "divisible by 32"),
    (["generate", "x", *MODEL, "--chat"], "has no chat template"),
    (["generate", "x", *MODEL, "--device", "tpu"],
     "--device must be one of auto, cpu, cuda, mps, got 'tpu'"),
    (["generate", "x", "-m", str(LLAMA2XS), "-n", "300"], "256 positions"),
    (["generate", "x", *MODEL, "--stop", "a\\"], "write \\\\ for a backslash"),
    (["generate", "x", *MODEL, "--stop", "C:\\users"], "truncated \\uXXXX escape"),
])
def test_user_errors_are_one_line_and_exit_2(args, fragment):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert "Traceback" not in result.output
    assert result.stderr.strip().startswith("error:")


def test_truncate_prompt_is_opt_in(llama2xs):
    from cli.context import PromptFlags, encode_prompt

    long_prompt = "Once upon a time " * 60
    refused = invoke("generate", long_prompt, "-m", str(LLAMA2XS), "-n", "100")
    assert refused.exit_code == 2 and "256 positions" in refused.stderr
    result = invoke("generate", long_prompt, "-m", str(LLAMA2XS), "-n", "100",
                    "--truncate-prompt", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_tokens"] == 256 - 100
    full = llama2xs.encode(long_prompt)
    assert f"--truncate-prompt: kept the prompt's last 156 of its {len(full)} tokens, so " \
        "that it and 100 new tokens fit the model's 256 positions" in result.stderr
    kept = encode_prompt(llama2xs, long_prompt, PromptFlags(truncate=True), 100)
    assert kept == full[:1] + full[len(full) - 155:]  # BOS, then the prompt's last tokens


def test_truncate_prompt_with_no_room_left_names_max_new_tokens():
    # -n fills the model's 256 positions: truncation cannot help, and the advice is to
    # lower -n (not to truncate, which is already on, nor to a negative -n)
    result = invoke("generate", "the dog ran. " * 200, "-m", str(LLAMA2XS), "-n", "300",
                    "--truncate-prompt")
    assert result.exit_code == 2, result.output
    assert "max_new_tokens (300) leaves no room for the prompt in the model's 256 " \
        "positions; lower it so that the prompt's tokens and it fit in 256" in result.stderr
    assert "Traceback" not in result.output


def test_context_message_when_the_prompt_alone_is_too_long():
    result = invoke("generate", "the dog ran. " * 200, *MODEL, "-n", "5")
    assert result.exit_code == 2
    assert "the prompt alone" in result.stderr and "to 0" not in result.stderr
    # beam has --truncate-prompt too: the advice names the commands that take it
    beam = invoke("beam", "the dog ran. " * 200, *MODEL, "-n", "5", "-k", "2")
    assert beam.exit_code == 2
    assert beam.stderr.strip().endswith("shorten the prompt (generate, beam, speculate and "
                                        "explain take --truncate-prompt, which keeps its "
                                        "last tokens)")


def test_a_reader_closing_the_pipe_ends_generation_quietly():
    """`genlab generate ... | head -c 5`: no error line, SIGPIPE's status. The generation
    must outlast the reader: 480 tokens on transformers' forward take ~0.5 s after the
    first is printed, so the closed pipe is written to."""
    proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", "Once upon a time",
                             *MODEL, "-n", "480", "--ignore-eos"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GENLAB_LEAN": "0"})
    assert proc.stdout.read(5) == b", the"
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    assert proc.returncode == 141


def test_ctrl_c_outside_a_generation_loop_is_one_line_and_exit_130(monkeypatch):
    import genlib.models.loading

    def load_model(*args, **kwargs):  # Ctrl-C while the model loads
        raise KeyboardInterrupt

    monkeypatch.setattr(genlib.models.loading, "load_model", load_model)
    result = invoke("generate", "Once upon a time", *MODEL)
    assert result.exit_code == 130
    assert result.stderr.strip() == "error: interrupted"


def test_ctrl_c_while_typer_builds_the_command_line_is_one_line_and_exit_130(
        monkeypatch, capsys):
    import signal

    import typer.main

    import cli.main

    def get_command(app):
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.main, "get_command", get_command)
    monkeypatch.setattr(sys, "argv", ["genlab", "generate", "x"])
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as ended:
            cli.main.run()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert ended.value.code == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_stop_flag_understands_escapes():
    result = invoke("generate", "Once upon a time", *MODEL, "-n", "200", "--stop", "\\n",
                    "--json")
    doc = json.loads(result.stdout)
    record = doc["outputs"][0]
    assert record["finish_reason"] == "stop" and "\n" not in record["text"]
    assert doc["settings"]["stop_strings"] == ["\n"]


@pytest.mark.parametrize("flag", ["--json", "--jsonl", "--stats", "--truncate-prompt"])
def test_batch_and_interactive_refuse_single_prompt_flags(tmp_path, flag):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once"}\n')
    for mode in (["--input", str(prompts)], ["-i"]):
        result = invoke("generate", *MODEL, *mode, flag)
        assert result.exit_code == 2, result.output
        assert f"{flag} only applies to a single prompt" in result.stderr


def test_the_retired_compile_flag_names_its_replacement_in_every_mode(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once"}\n')
    for mode in (["Once"], ["--input", str(prompts)], ["-i"]):
        result = invoke("generate", *MODEL, *mode, "--compile")
        assert result.exit_code == 2, result.output
        assert "--compile was replaced by --backend: --backend native" in result.stderr


def test_unexpected_errors_are_one_line_exit_1(monkeypatch):
    import cli.generate

    def broken(*args, **kwargs):
        raise RuntimeError("boom\n  at the second of torch's many lines\n")

    monkeypatch.setattr(cli.generate, "run_generation", broken)
    result = invoke("generate", "Once", *MODEL, "-n", "2")
    assert result.exit_code == 1
    assert result.stderr.strip() == ("error: unexpected RuntimeError: boom (run with "
                                     "GENLAB_DEBUG=1 for the traceback)")


def test_interactive_prompt_goes_to_stderr_when_stdout_is_piped():
    proc = subprocess.run([*genlab_exe(), "generate", "-i", *MODEL, "-n", "6"],
                          input="Once upon a time\n/quit\n", capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "genlab>" not in proc.stdout and "genlab>" in proc.stderr
    assert ", there was a little" in proc.stdout


def test_presets_list_and_show():
    listed = invoke("presets", "list")
    assert listed.exit_code == 0
    for name in ("greedy", "creative", "precise", "topk", "beam"):
        assert name in listed.stdout
    shown = invoke("presets", "show", "creative")
    import yaml

    data = yaml.safe_load(shown.stdout)
    assert data["strategy"] == "sample" and data["top_p"] == 0.92 and data["top_k"] == 0
    assert invoke("presets", "show", "nope").exit_code == 2


def test_help_does_not_import_torch():
    code = ("import sys; sys.argv=['genlab','generate','--help']\n"
            "from cli.main import app\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "sys.stderr.write('HEAVY=' + ','.join(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)
    assert "HEAVY=" in proc.stderr and proc.stderr.strip().endswith("HEAVY="), proc.stderr


@pytest.mark.parametrize("args,line", [
    (["generate", "-n", "abc", "x"],
     "error: invalid value for '--max-new-tokens' / '-n': Input should be a valid integer, "
     "unable to parse string as an integer; see 'genlab generate -h'"),
    (["beam", "--zqx", "x"], "error: no such option: --zqx; see 'genlab beam -h'"),
    (["nosuch"], "error: no such command 'nosuch'; see 'genlab -h'"),
    (["presets", "show"], "error: missing argument 'name'; see 'genlab presets show -h'"),
])
def test_usage_errors_are_one_line(args, line):
    """A flag Typer cannot take reads like every other error: one line, exit 2, stdout
    untouched (Typer's own is a usage line, a hint and a box)."""
    code = ("import sys; from cli.main import run; sys.argv = ['genlab', *sys.argv[1:]]; "
            "run()")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"}, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", line + "\n")


def test_no_arguments_still_show_the_help():
    proc = subprocess.run([sys.executable, "-m", "cli", "presets"], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "NO_COLOR": "1"}, timeout=60)
    assert proc.returncode == 2 and "list" in proc.stdout and "show" in proc.stdout


def genlab_exe() -> list[str]:
    """The installed console script when there is one (CI installs it), else the module."""
    found = shutil.which("genlab")
    return [found] if found else [sys.executable, "-m", "cli"]


def test_real_subprocess_pipe():
    """`genlab` as a user runs it: prompt piped in, plain text out, exit 0."""
    exe = genlab_exe()
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*exe, "generate", *MODEL, "-n", "15"], input="Once upon a time",
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(", there was a little girl")
    bad = subprocess.run([*exe, "generate", "x", "-m", "/nope"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_ctrl_c_keeps_printed_text_and_exits_130():
    if not CODE_TARGET.is_dir():
        pytest.skip("code-target not present")
    env = {**os.environ, "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*genlab_exe(), "generate", "def main():", "-m", str(CODE_TARGET),
                             "-n", "1000", "--ignore-eos"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=env)
    first = proc.stdout.read(20)  # generation has started streaming
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(first) == 20 and b"Traceback" not in err
    assert len(first + rest) < 6000  # stopped long before 1000 tokens


PROMPT = "Once upon a time"
PIPED = {
    "beam": ["beam", PROMPT, *MODEL, "-n", "30", "-k", "3"],
    "compare": ["compare", PROMPT, *MODEL, "-n", "8", "-p", "greedy"],
    "explain": ["explain", PROMPT, *MODEL, "-n", "4"],
    "presets list": ["presets", "list"],
    "presets keys": ["presets", "keys"],
    "help": ["--help"],
    "version": ["--version"],
    "generate --json": ["generate", PROMPT, *MODEL, "-n", "8", "--json"],
}


@pytest.mark.parametrize("args", PIPED.values(), ids=PIPED.keys())
def test_a_reader_gone_before_the_output_ends_any_command_quietly_with_141(args):
    """`genlab beam ... | true`: tables, panels and --help (Rich's consoles, whose own
    answer is exit 1) stop like the streamed text and the JSON do: no message, 141."""
    proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"})
    proc.stdout.close()  # the reader goes away before reading anything
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    assert proc.returncode == 141


EXPORTS = {
    "compare --markdown": (["compare", PROMPT, *MODEL, "-n", "8", "-p", "greedy",
                            "--markdown"], "## greedy"),
    "compare --models --markdown": (["compare", PROMPT, "--models", f"{STORIES},{STORIES}",
                                     "-n", "8", "--markdown"], "| model | tokens/s |"),
    "bench --csv": (["bench", *MODEL, "--runs", "1", "--warmup", "0", "--prompt-len", "4",
                     "--new-tokens", "3", "--no-bandwidth", "--csv"], "new_tokens"),
    "bench --jsonl --csv": (["bench", *MODEL, "--runs", "1", "--warmup", "0", "--prompt-len",
                             "4", "--new-tokens", "3", "--no-bandwidth", "--jsonl", "--csv"],
                            "new_tokens"),
    "compare --jsonl --markdown": (["compare", PROMPT, *MODEL, "-n", "8", "-p", "greedy",
                                    "--jsonl", "--markdown"], "## greedy"),
}


@pytest.mark.parametrize("args, header", EXPORTS.values(), ids=EXPORTS.keys())
def test_a_reader_gone_during_the_view_costs_no_export_file(args, header, tmp_path):
    """`genlab compare ... --markdown out.md | head -3`: the table on stdout meets a closed
    pipe, and the file is written all the same before the quiet 141."""
    export = tmp_path / "export"
    proc = subprocess.Popen([sys.executable, "-m", "cli", *args, str(export)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"})
    proc.stdout.close()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 141, err.decode()
    assert header in export.read_text()


def terminated_json(wait_s: float) -> dict:
    """`genlab generate --json` on code-target (1000 tokens take a minute), sent SIGTERM
    `wait_s` after the model is loaded (--show-settings' table on stderr): its document."""
    proc = subprocess.Popen([sys.executable, "-m", "cli", "generate", "def g():", "-m",
                             str(CODE_TARGET), "-n", "1000", "--ignore-eos", "--backend",
                             "transformers", "--json", "--show-settings"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"})
    for line in proc.stderr:
        if line.split()[:1] == [b"grammar"]:  # the table's last row
            break
    time.sleep(wait_s)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert b"Traceback" not in err and b"error:" not in err
    return json.loads(out)


def test_sigterm_writes_the_json_so_far_and_exits_143():
    """`timeout 60 genlab generate --json ...`: SIGTERM stops the run as Ctrl-C does (a
    whole document, the output marked interrupted), not with nothing on stdout; the
    status is SIGTERM's (128 + 15)."""
    if not CODE_TARGET.is_dir():
        pytest.skip("code-target not present")
    for wait_s in (2.0, 5.0, 10.0):  # until the signal lands after the first token
        doc = terminated_json(wait_s)
        if doc["outputs"] and doc["outputs"][0]["new_tokens"]:
            break
    (output,) = doc["outputs"]
    assert output["finish_reason"] == "interrupted"
    assert 0 < output["new_tokens"] < 1000


@pytest.mark.slow
def test_sigterm_ends_a_batch_run_with_whole_lines_and_143(tmp_path):
    """A batch run under SIGTERM keeps what it wrote: every line whole, each id once,
    and a rerun finishes the rest, as after Ctrl-C."""
    src, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Once upon a time {i}"})
                           + "\n" for i in range(200)))
    command = [sys.executable, "-m", "cli", "generate", *MODEL, "--input", str(src), "-o",
               str(results), "-n", "200", "--ignore-eos", "--batch-size", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    wait_for_lines(results, 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert b"Traceback" not in err
    ids = [json.loads(line)["id"] for line in results.read_text().splitlines()]
    assert 2 <= len(ids) < 200 and len(set(ids)) == len(ids)
    rerun = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    ids = [json.loads(line)["id"] for line in results.read_text().splitlines()]
    assert sorted(ids) == sorted(f"p{i}" for i in range(200))


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def saved_with_template(stories, folder, template: str):
    """stories260K saved to `folder` with a chat template, as a local model folder."""
    stories.model.save_pretrained(folder)
    stories.tokenizer.chat_template = template
    try:
        stories.tokenizer.save_pretrained(folder)
    finally:
        stories.tokenizer.chat_template = None
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, stories):
    """stories260K with a (toy) chat template."""
    return saved_with_template(stories, tmp_path_factory.mktemp("chat-model"), CHAT_TEMPLATE)


def test_chat_applies_template_with_system_message(chat_model):
    from genlib.models.loading import ModelSpec, load_model

    lm = load_model(ModelSpec(str(chat_model)))
    ids = lm.encode_chat([{"role": "system", "content": "Be kind."},
                          {"role": "user", "content": "Hi"}])
    expected = lm.tokenizer("<system>Be kind.\n<user>Hi\n<assistant>", add_special_tokens=False)
    assert lm.tokenizer.decode(ids) == lm.tokenizer.decode(expected["input_ids"])
    result = invoke("generate", "Hi", "-m", str(chat_model), "--chat", "--system", "Be kind.",
                    "-n", "5", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_tokens"] == len(ids)


STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                   "{{ raise_exception('System role not supported') }}{% endif %}"
                   "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>")


@pytest.fixture(scope="module")
def strict_chat_model(tmp_path_factory, stories):
    """stories260K with a chat template that refuses system messages (as Gemma's does)."""
    return saved_with_template(stories, tmp_path_factory.mktemp("strict-chat-model"),
                               STRICT_TEMPLATE)


def test_chat_template_refusing_the_system_message_is_one_input_error(strict_chat_model):
    result = invoke("generate", "Hi", "-m", str(strict_chat_model), "--chat", "--system",
                    "Be kind.", "-n", "3")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"error: the chat template of {strict_chat_model} cannot render this conversation "
        f"(System role not supported); drop the system message (--system) and put its "
        f"text in the prompt")
    assert result.stdout == ""
    plain = invoke("generate", "Hi", "-m", str(strict_chat_model), "--chat", "-n", "3")
    assert plain.exit_code == 0, plain.output


def test_no_model_named_uses_the_builtin_model_offline(monkeypatch):
    monkeypatch.delenv("GENLAB_MODEL", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("generate", "def fibonacci(n):", "-n", "24", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    record = doc["outputs"][0]
    assert doc["model"] == "builtin:code-small" and record["new_tokens"] >= 1
    assert record["text"].strip()


def test_every_setting_flag_is_made_from_the_settings_declaration():
    """Each setting is declared once (SPECS); every command's flag for it has the
    declared names and panel and sets that setting, and generate and beam between them
    offer every setting."""
    from typer.main import get_command

    from genlib.settings.config import SPECS

    commands = get_command(app).commands
    declared = {name: key for key, spec in SPECS.items()
                for flag in spec.flag.names for name in flag.split("/")}
    offered: set[str] = set()
    for command in ("generate", "beam", "explain", "speculate", "compare"):
        for param in commands[command].params:
            names = param.opts + param.secondary_opts
            keys = {declared[name] for name in names if name in declared}
            if not keys or (command, param.name) == ("compare", "samples"):
                continue  # compare's --samples: outputs per strategy, not the setting
            assert keys == {param.name}, (command, names, keys)
            spec = SPECS[param.name]
            assert names == [n for flag in spec.flag.names for n in flag.split("/")]
            assert param.rich_help_panel == spec.flag.panel, (command, param.name)
            offered.add(param.name)
    assert offered == set(SPECS)


def test_given_settings_read_the_flags_values():
    from cli.options import given_settings

    flags = given_settings({"stop_strings": ["\\n"], "top_k": 5, "seed": None,
                            "early_stopping": "never", "force_words": [],
                            "ignore_eos": False}, prompt="x")
    assert flags == {"stop_strings": ["\n"], "top_k": 5, "early_stopping": "never"}


def test_sampling_flags_under_greedy_are_named_in_one_warning():
    result = invoke("generate", "Once upon a time", *MODEL, "-n", "3", "-s", "greedy",
                    "-t", "0.7")
    assert result.exit_code == 0, result.output
    assert "warning: temperature only applies when sampling; strategy is greedy" \
        in result.stderr


def test_show_settings_keeps_every_value_readable_at_80_columns(tmp_path):
    """A preset's path in the source column once took the whole width and left the value
    column none; the path now wraps, each value stays whole, and the model column is
    there only when the model has a generation_config.json to compare."""
    folder = tmp_path / "a-rather-long-folder-name-for-presets" / "and-another-level"
    folder.mkdir(parents=True)
    preset = folder / "mine.yaml"
    preset.write_text("name: mine\ntop_p: 0.85\n")
    result = runner.invoke(app, ["generate", "Once", *MODEL, "-n", "2", "-t", "0.9",
                                 "-p", str(preset), "--show-settings"],
                           env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split("│") for line in result.stderr.splitlines()
            if "│" in line and line.split()[0] != "│"}
    assert rows["temperature"][1].strip() == "0.9"
    assert rows["top_p"][1].strip() == "0.85" and "preset mine" in rows["top_p"][2]
    assert rows["top_k"][1].strip() == "0"
    assert all(len(line) <= 80 for line in result.stderr.splitlines())
    assert "generation_config" not in result.stderr.splitlines()[1]  # stories260K has none to show


def test_sigterm_inside_a_finalizer_is_delivered_again_not_lost():
    """A SIGTERM whose handler runs inside a `__del__` (the garbage collector's, at any
    moment) would raise where Python ignores exceptions, and the run would go on to its
    end with status 0; the handler sees that and delivers the signal again."""
    import sys as _sys

    from cli.main import in_finalizer

    seen = []

    class Finalized:
        def __del__(self):
            seen.append(in_finalizer(_sys._getframe()))

    Finalized()
    assert seen == [True]
    assert not in_finalizer(_sys._getframe())


LEAN_CANNOT_BEAM = ("the lean backend runs one row, and this generation needs beam search; "
                    "use --backend native or transformers (or auto)")


@pytest.mark.parametrize("args, backend, said", [
    (["beam", "Once", "-n", "3", "-k", "2"], "lean", LEAN_CANNOT_BEAM),
    (["explain", "Once", "-n", "3", "--dola-layers", "low"], "transformers",
     "the transformers backend gives no hidden states, which DoLa needs"),
    (["compare", "Once", "-n", "3", "--variant", "strategy=beam,num_beams=2", "--json"],
     "lean", LEAN_CANNOT_BEAM),
    (["generate", "-i", "-n", "3"], "lean", LEAN_CANNOT_BEAM),
])
def test_the_backend_asked_for_reaches_each_commands_generation(args, backend, said):
    """--backend travels with the request of every command's generation (not on the
    loaded model): a backend that cannot serve it is refused there, naming itself."""
    typed = "/set strategy=beam num_beams=2\nOnce\n/quit\n" if "-i" in args else None
    result = invoke(*args, *MODEL, "--backend", backend, input=typed)
    assert said in result.output, result.output


def test_emoji_codes_in_user_text_stay_text():
    """Rich turned ":smile:" in a prompt and ":-1:" in an --ensemble value into emoji."""
    beam = invoke("beam", "x :smile: y", *MODEL, "-n", "2", "-k", "2")
    assert beam.exit_code == 0 and "beam search: 'x :smile: y'" in beam.output
    refused = invoke("generate", "Once", *MODEL, "--ensemble", f"{LLAMA2XS}:-1")
    assert refused.exit_code == 2 and f"{LLAMA2XS}:-1: the weight" in refused.stderr
