"""Write each command's usage into its page under docs/commands/, from `--help` itself.

A page is prose written by hand, then the usage between two markers; only the part
between the markers is rewritten, so the prose stays as written. A command group's page
(`presets`) holds the group's usage, then a `## genlab GROUP SUB` section for each of
its subcommands with that subcommand's usage between markers naming it; a missing
section is appended, prose written around one is kept. tests/test_docs.py fails when a
page's usage differs from `--help` (run this script to update it).

    python scripts/gen_docs.py          # rewrite the usage blocks
    python scripts/gen_docs.py --check  # exit 1 when one is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "commands"
BEGIN = "<!-- usage: written by scripts/gen_docs.py from --help; do not edit -->"
SUB_BEGIN = "<!-- usage of genlab {command}: written by scripts/gen_docs.py from --help; " \
            "do not edit -->"
SUB_BEGIN_PATTERN = re.compile(r"<!-- usage of genlab (.+?): written by scripts/gen_docs\.py")
END = "<!-- /usage -->"
KEYS_PAGE = ROOT / "docs" / "presets.md"
KEYS_BEGIN = "<!-- keys: written by scripts/gen_docs.py from the settings' declarations; " \
             "do not edit -->"
KEYS_END = "<!-- /keys -->"
COMMANDS = ("generate", "beam", "compare", "speculate", "bench", "explain", "presets",
            "cache", "daemon")
WIDTH = 100


def cli_app():
    """genlab's Typer app, imported from this checkout."""
    sys.path.insert(0, str(ROOT))
    from cli.main import app

    return app


def help_text(command: str) -> str | None:
    """`genlab COMMAND --help` as plain text at WIDTH columns (COMMAND may be a group
    and a subcommand, `presets list`); None for a command this genlab does not have."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli_app(), [*command.split(), "--help"], env={
        "COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH), "NO_COLOR": "1",
        "_TYPER_FORCE_DISABLE_TERMINAL": "1"})
    if result.exit_code != 0:
        return None
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()).strip() + "\n"


def subcommands(command: str) -> tuple[str, ...]:
    """The subcommands of a command group as `GROUP SUB`, in the order its help lists
    them; none for a plain command or one this genlab does not have."""
    from typer.core import TyperGroup
    from typer.main import get_command

    found = get_command(cli_app()).commands.get(command)
    if not isinstance(found, TyperGroup):
        return ()
    return tuple(f"{command} {name}" for name in found.commands)


def documented_commands() -> tuple[str, ...]:
    """Every command whose usage a page carries: the commands and their subcommands."""
    return tuple(name for command in COMMANDS
                 for name in (command, *subcommands(command)))


def begin_marker(command: str) -> str:
    """The marker opening COMMAND's usage block: a subcommand's names it, since its
    page holds several blocks."""
    return SUB_BEGIN.format(command=command) if " " in command else BEGIN


def usage_block(command: str) -> str | None:
    text = help_text(command)
    return None if text is None else f"{begin_marker(command)}\n```text\n{text}```\n{END}"


def page_path(command: str) -> Path:
    """The page of a command, or of the group a subcommand belongs to."""
    return PAGES / f"{command.split()[0]}.md"


def updated(page: str, block: str, command: str | None = None) -> str:
    """`page` with COMMAND's usage block replaced; appended when it has none, under
    `## Usage` for a command and under `## genlab COMMAND` for a subcommand."""
    begin = BEGIN if command is None else begin_marker(command)
    if begin in page and END in page.split(begin, 1)[1]:
        head, rest = page.split(begin, 1)
        return head + block + rest.split(END, 1)[1]
    heading = "Usage" if command is None or " " not in command else f"genlab {command}"
    return page.rstrip() + f"\n\n## {heading}\n\n" + block + "\n"


def refreshed(command: str, page: str) -> str:
    """COMMAND's page with its usage, and each of its subcommands', as --help has them."""
    for name in (command, *subcommands(command)):
        block = usage_block(name)
        if block is not None:
            page = updated(page, block, name)
    return page


def gone_subcommands(command: str, page: str) -> list[str]:
    """Subcommands whose usage the page still carries but genlab no longer has."""
    current = set(subcommands(command))
    return [name for name in SUB_BEGIN_PATTERN.findall(page) if name not in current]


def keys_table() -> str:
    """The settings table of docs/presets.md, made from the settings' declarations
    (genlib.settings.config.SPECS), as `genlab presets keys` shows them."""
    sys.path.insert(0, str(ROOT))
    from genlib.settings.config import SPECS

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def default(value: object) -> str:
        if value is None:
            return "none"
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, tuple):
            return f"`{value!r}`" if value else "[]"
        return str(value)

    rows = [f"| `{key}` | `{spec.flag.names[0].split('/')[0]}` | {cell(default(spec.default))} "
            f"| {cell(spec.allowed or ', '.join(spec.choices) or spec.kind)} "
            f"| {cell(spec.help)} |" for key, spec in SPECS.items()]
    return "\n".join([KEYS_BEGIN, "| key | flag | default | allowed | meaning |",
                      "| --- | --- | --- | --- | --- |", *rows, KEYS_END])


def refreshed_keys(page: str) -> str:
    """docs/presets.md with its settings table as the declarations make it."""
    head, rest = page.split(KEYS_BEGIN, 1)
    return head + keys_table() + rest.split(KEYS_END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale, gone = [], []
    for command in COMMANDS:
        if help_text(command) is None:
            continue
        path = page_path(command)
        page = path.read_text() if path.exists() else f"# genlab {command}\n"
        new = refreshed(command, page)
        gone += [f"{path.name}: genlab {name}" for name in gone_subcommands(command, new)]
        if new != page:
            stale.append(path.name)
            if not args.check:
                path.write_text(new)
    page = KEYS_PAGE.read_text()
    if refreshed_keys(page) != page:
        stale.append(KEYS_PAGE.name)
        if not args.check:
            KEYS_PAGE.write_text(refreshed_keys(page))
    for entry in gone:
        print(f"usage of a command genlab no longer has ({entry}): delete its section")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)} (run python scripts/gen_docs.py)")
    return 1 if gone or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
