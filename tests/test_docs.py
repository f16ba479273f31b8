"""The docs match the program: every command's page holds its current `--help` (a
group's page each subcommand's too), the flags its prose and its options tables name
exist (and none is a retired one), and the README's links lead to pages that exist."""

from __future__ import annotations

import re
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
