"""The docs match the program: every command's page holds its current `--help` (a
group's page each subcommand's too), the flags its prose and its options tables name
exist (and none is a retired one), every example command line parses against genlab's
options, every relative link in the README and docs/ leads to a file that exists
(and a #anchor to a heading of it), and the output a page shows for one of its commands
is what that command prints today."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs  # noqa: E402

USAGE_BLOCK = re.compile(r"<!-- usage.*?<!-- /usage -->", re.S)
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])(?![\w-])")
FENCED = re.compile(r"```.*?```", re.S)
CELL_BORDER = re.compile(r"(?<!\\)\|")  # a `|` that is not escaped as `\|` in a cell


def flags_in(text: str) -> set[str]:
    return set(FLAG.findall(text))


def table_flags(page: str) -> set[str]:
    """The flags in the first column of a page's hand-written tables (rows like
    "| `--flag` | ... |"; code blocks and the generated usage left out)."""
    found: set[str] = set()
    for line in FENCED.sub("", USAGE_BLOCK.sub("", page)).splitlines():
        cells = CELL_BORDER.split(line.strip())
        if line.strip().startswith("|") and len(cells) >= 3:
            found |= flags_in(cells[1])
    return found


def click_command(command: str):
    from typer.main import get_command

    found = get_command(gen_docs.cli_app())
    for name in command.split():
        found = found.commands[name]
    return found


def help_flags(page_command: str) -> set[str]:
    """The flags `--help` lists for a page's command (and a group's subcommands)."""
    return {flag for name in gen_docs.documented_commands()
            if gen_docs.page_path(name) == gen_docs.page_path(page_command)
            for flag in flags_in(gen_docs.help_text(name) or "")}


def retired_flags(page_command: str) -> set[str]:
    """The hidden options of a page's command: retired flags kept only to name their
    replacement (`--compile`)."""
    return {flag for name in gen_docs.documented_commands()
            if gen_docs.page_path(name) == gen_docs.page_path(page_command)
            for param in click_command(name).params if getattr(param, "hidden", False)
            for flag in param.opts}


def table_flag_problems(command: str, page: str) -> list[str]:
    """What a page's options tables name that its command's `--help` does not offer."""
    named, offered, retired = table_flags(page), help_flags(command), retired_flags(command)
    return [f"{flag}: retired" if flag in retired else f"{flag}: not in genlab {command} --help"
            for flag in sorted(named - offered)]


@pytest.mark.parametrize("command", gen_docs.documented_commands())
def test_each_command_page_holds_its_current_help(command):
    block = gen_docs.usage_block(command)
    if block is None:
        pytest.skip(f"no {command} command")
    page = gen_docs.page_path(command).read_text()
    assert block in page, f"docs/commands/{gen_docs.page_path(command).name} is out of " \
                          f"date for genlab {command}: run python scripts/gen_docs.py"


def test_the_presets_group_documents_each_subcommand():
    assert gen_docs.subcommands("presets") == ("presets list", "presets show", "presets keys")
    assert gen_docs.subcommands("generate") == ()
    page = gen_docs.page_path("presets list").read_text()
    for name in ("list", "show", "keys"):
        assert f"## genlab presets {name}\n" in page
        assert gen_docs.begin_marker(f"presets {name}") in page
    assert gen_docs.gone_subcommands("presets", page) == []


def test_the_check_fails_when_a_subcommands_help_changes(monkeypatch, capsys):
    real = gen_docs.help_text

    def changed(command):
        text = real(command)
        return text + "a new line\n" if command == "presets show" else text

    monkeypatch.setattr(gen_docs, "help_text", changed)
    assert gen_docs.main(["--check"]) == 1
    assert "out of date: presets.md" in capsys.readouterr().out


def test_regenerating_keeps_the_prose_around_subcommand_sections(monkeypatch):
    monkeypatch.setattr(gen_docs, "help_text", lambda command: f"help of {command}\n")
    monkeypatch.setattr(gen_docs, "subcommands",
                        lambda command: ("g a", "g b") if command == "g" else ())
    old_a = gen_docs.begin_marker("g a") + "\n```text\nold help\n```\n" + gen_docs.END
    page = ("# genlab g\n\nIntro.\n\n## Usage\n\n" + gen_docs.BEGIN + "\nold\n"
            + gen_docs.END + "\n\n## genlab g a\n\nHow a is used.\n\n" + old_a
            + "\n\nAfter a.\n")
    new = gen_docs.refreshed("g", page)
    assert new == ("# genlab g\n\nIntro.\n\n## Usage\n\n" + gen_docs.usage_block("g")
                   + "\n\n## genlab g a\n\nHow a is used.\n\n" + gen_docs.usage_block("g a")
                   + "\n\nAfter a.\n\n## genlab g b\n\n" + gen_docs.usage_block("g b") + "\n")
    assert gen_docs.refreshed("g", new) == new


def test_a_subcommand_genlab_no_longer_has_is_reported(monkeypatch):
    monkeypatch.setattr(gen_docs, "subcommands", lambda command: ("g a",))
    page = gen_docs.begin_marker("g a") + gen_docs.begin_marker("g gone")
    assert gen_docs.gone_subcommands("g", page) == ["g gone"]


def test_flags_named_on_the_presets_page_exist_in_its_usage():
    page = gen_docs.page_path("presets").read_text()
    usage = "".join(USAGE_BLOCK.findall(page))
    named = flags_in(USAGE_BLOCK.sub("", page))
    assert {"--json", "-o"} <= named
    assert sorted(named - flags_in(usage)) == []


@pytest.mark.parametrize("command", gen_docs.COMMANDS)
def test_each_pages_options_tables_name_only_flags_its_help_has(command):
    page = gen_docs.page_path(command).read_text()
    assert table_flag_problems(command, page) == []


def test_the_options_tables_are_read_and_compile_is_retired():
    bench = table_flags(gen_docs.page_path("bench").read_text())
    generate = table_flags(gen_docs.page_path("generate").read_text())
    assert {"--backend", "--baseline", "-s", "--strategy", "--no-bandwidth"} <= bench
    assert {"--backend", "-m", "--model", "--device", "--samplers", "--json-schema"} <= generate
    assert "--compile" in retired_flags("bench") and "--compile" in retired_flags("generate")
    assert "--compile" not in bench | generate


def test_a_table_row_naming_a_flag_genlab_lacks_or_retired_fails():
    page = gen_docs.page_path("bench").read_text()
    row = "| `--no-cache` |"
    assert row in page
    fake = page.replace(row, "| `--compile`, `--no-such-flag N` | made up |\n" + row)
    assert table_flag_problems("bench", fake) == [
        "--compile: retired", "--no-such-flag: not in genlab bench --help"]
    escaped = page.replace(row, "| `--dtype auto\\|float8`, `--made-up` | x |\n" + row)
    assert table_flag_problems("bench", escaped) == ["--made-up: not in genlab bench --help"]


def test_the_docs_name_only_presets_subcommands_genlab_has():
    subcommands = {name.split()[1] for name in gen_docs.subcommands("presets")}
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    named = {word for path in texts
             for word in re.findall(r"genlab presets ([a-z][a-z-]*)", path.read_text())}
    assert named and named <= subcommands, sorted(named - subcommands)


def test_the_readme_links_lead_somewhere_and_it_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / target).exists(), target


RESULTS = ROOT / "benchmarks" / "results"
RECORD_NAME = re.compile(r"`([\w.-]+\.(?:md|txt|json|png))`")


def missing_records(page: str) -> list[str]:
    """The results files a page cites by name (`2026-11-25-gc-freeze.md`) that
    benchmarks/results/ does not hold; names inside code blocks are left out."""
    return sorted({name for name in RECORD_NAME.findall(prose(page))
                   if not (RESULTS / name).exists()})


def test_the_performance_page_is_short_and_its_records_exist():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert len(page.splitlines()) < 250
    assert len(RECORD_NAME.findall(prose(page))) >= 20
    assert missing_records(page) == []
    assert missing_records("`ray.md`, `2026-01-01-never-measured.txt`") == \
        ["2026-01-01-never-measured.txt"]


def test_benchmark_results_hold_records_not_trial_code():
    """Trial patches and scripts live in git history (a record names the commit), not in
    the tree: benchmarks/results/ holds what was measured."""
    code = [path.relative_to(ROOT) for path in RESULTS.rglob("*")
            if path.suffix in {".patch", ".diff", ".py", ".c", ".sh"}]
    assert code == []


# --- links --------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:: not a file here
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """A page without its fenced code blocks, where `](` and `#` are code, not links."""
    return FENCED.sub("", text)


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """A page's heading anchors; a repeated heading's later ones get -1, -2, ..."""
    found: set[str] = set()
    for heading in HEADING.findall(prose(text)):
        anchor, n = heading_anchor(heading), 0
        while (anchor if n == 0 else f"{anchor}-{n}") in found:
            n += 1
        found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def link_problems(page: Path, text: str) -> list[str]:
    """The relative links of a page (at `page`, holding `text`) that lead nowhere: to no
    file or folder, or to a heading the target page lacks."""
    problems = []
    for target in LINK.findall(prose(text)):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        found = (page.parent / path).resolve() if path else page
        if not found.exists():
            problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif anchor and found.suffix == ".md":
            page_text = text if found == page else found.read_text()
            if anchor not in anchors(page_text):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    return problems


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    assert link_problems(page, page.read_text()) == []


def test_a_made_up_link_or_heading_fails():
    page = ROOT / "docs" / "presets.md"  # where the links are read from
    text = ("# A page\n\n[a](samplers.md) [b](no-such-page.md) [c](../README.md#backends)"
            " [d](performance.md#no-such-heading) [e](#no-such-section) [f](#a-page)"
            " [g](https://example.com/x.md) [h](commands/)\n\n"
            "```\n[i](in-a-code-block.md)\n```\n")
    assert link_problems(page, text) == [
        "docs/presets.md: no-such-page.md: no such file",
        "docs/presets.md: performance.md#no-such-heading: no such heading",
        "docs/presets.md: #no-such-section: no such heading",
    ]


def test_heading_anchors_are_githubs():
    assert heading_anchor("Decoding speed (`genlab bench`)") == "decoding-speed-genlab-bench"
    assert heading_anchor("Batch generation (`--input` / `--batch-size`)") == \
        "batch-generation---input----batch-size"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


# --- example command lines ------------------------------------------------------------

CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL = ("bash", "sh", "console", "")
SEPARATORS = {"|", "||", "&&", ";"}
RUNS_GENLAB = re.compile(r"(^|[|;&]\s*)genlab(\s|$)")
REDIRECT = re.compile(r"\d?>>?.*|<.*")


def example_commands(text: str) -> list[list[str]]:
    """The argument lists of the `genlab` command lines in a page's shell blocks (a
    console block's `$ ` lines only; the other lines there are output), pipes and
    redirections cut off."""
    found = []
    for language, body in CODE_BLOCK.findall(text):
        for line in body.replace("\\\n", " ").splitlines():
            if language not in SHELL or (language == "console" and not line.startswith("$ ")):
                continue
            line = line.removeprefix("$ ").strip()
            if not RUNS_GENLAB.search(line):  # output or prose in an unlabelled block
                continue
            words = shlex.split(line, comments=True)
            for n, word in enumerate(words):
                if word == "genlab" and (n == 0 or words[n - 1] in SEPARATORS):
                    found.append(_one_command(words[n + 1:]))
    return found


def _one_command(words: list[str]) -> list[str]:
    args = []
    for word in words:
        if word in SEPARATORS or REDIRECT.fullmatch(word):
            break
        args.append(word)
    return args


def command_line_problem(args: list[str]) -> str | None:
    """Why `genlab ARGS` would be refused before it runs (an unknown flag, a missing or
    extra argument, a bad value), or None."""
    import typer
    from typer.main import get_command

    command, name, parent = get_command(gen_docs.cli_app()), "genlab", None
    while hasattr(command, "commands") and args and args[0] in command.commands:
        # the groups' contexts, whose settings (-h) the subcommand inherits
        parent = command.context_class(command, info_name=name, parent=parent,
                                       **command.context_settings)
        name += f" {args[0]}"
        command, args = command.commands[args[0]], args[1:]
    line = shlex.join([*name.split(), *args])
    if hasattr(command, "commands") and args and not args[0].startswith("-"):
        return f"{line}: {name} has no command {args[0]!r}"
    try:
        command.make_context(name, list(args), parent=parent)
    except typer.Exit:  # -h, --version: answered while parsing
        pass
    except typer.TyperException as error:  # click's usage errors, as Typer vendors them
        return f"{line}: {error.format_message()}"
    return None


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_command_line_parses(page):
    commands = example_commands(page.read_text())
    problems = [p for args in commands if (p := command_line_problem(args)) is not None]
    assert problems == []


def test_the_examples_are_read_and_a_bad_one_fails():
    compare = example_commands(gen_docs.page_path("compare").read_text())
    assert ["compare", "Once upon a time", "--json"] in compare  # piped into jq: cut there
    console = example_commands("```console\n$ genlab beam x -k 2\ngenlab> output\n```\n")
    assert console == [["beam", "x", "-k", "2"]]
    assert command_line_problem(["compare", "p", "--json", "out.json"]) == \
        "genlab compare p --json out.json: Got unexpected extra argument(s) (out.json)"
    assert "No such option" in command_line_problem(["generate", "p", "--no-such-flag"])
    assert command_line_problem(["compare", "p", "--json", "-o", "out.json"]) is None
    assert command_line_problem(["compare", "-h"]) is None
    assert command_line_problem(["presets", "shwo", "creative"]) == \
        "genlab presets shwo creative: genlab presets has no command 'shwo'"
    assert command_line_problem(["presets", "show"]) == \
        "genlab presets show: Missing argument 'name'."


# --- what the pages show --------------------------------------------------------------

def shell_block_with(page: Path, needle: str) -> str:
    """The first bash block of a page that holds `needle`."""
    return next(body for language, body in CODE_BLOCK.findall(page.read_text())
                if language == "bash" and needle in body)


def markdown_rows(text: str) -> dict[str, list[str]]:
    """A Markdown table's rows by their first cell, bold dropped."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip().strip("*") for cell in CELL_BORDER.split(line.strip())[1:-1]]
        if line.startswith("|") and len(cells) > 1:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_the_compare_page_shows_what_its_stories260k_command_prints():
    """The metrics table under "What it shows on stories260K" is the output of the
    command quoted above it, as run today (the sampled columns' draws included)."""
    from typer.testing import CliRunner

    from cli.main import app
    from tests.conftest import SHARED_MODELS

    page = gen_docs.page_path("compare").read_text()
    section = page.split("### What it shows on stories260K", 1)[1].split("\n### ", 1)[0]
    command = re.search(r"^`genlab (compare [^`]+)`", section, re.M).group(1)
    args = shlex.split(command.replace("../shared/models/", f"{SHARED_MODELS}/"))[1:]
    result = CliRunner().invoke(app, ["compare", *args])
    assert result.exit_code == 0, result.output
    printed, shown = markdown_rows(result.stdout), markdown_rows(section)
    assert shown.keys() >= {"perplexity", "repeated 4-grams", "diversity (samples)"}
    assert {metric: printed[metric] for metric in shown} == shown


@pytest.mark.slow
def test_the_samplers_pages_json_schema_example_runs_as_written(tmp_path):
    """The grammar section's first example, run by the shell from an empty folder: the
    schema file it reads is made in the block, and the output is valid against it."""
    pytest.importorskip("xgrammar")
    import jsonschema

    block = shell_block_with(ROOT / "docs" / "samplers.md", "--json-schema person.json")
    lines = block.splitlines()
    first = next(n for n, line in enumerate(lines) if line.startswith("genlab generate"))
    script = "genlab() { python -m cli \"$@\"; }\n" + "\n".join(lines[:first + 1])
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads((tmp_path / "person.json").read_text())
    jsonschema.validate(json.loads(proc.stdout), schema)
