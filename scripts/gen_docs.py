"""Write each command's usage into its page under docs/commands/, from `--help` itself.

A page is prose written by hand, then the usage between two markers; only the part
between the markers is rewritten, so the prose stays as written. tests/test_docs.py
fails when a page's usage differs from `--help` (run this script to update it).

    python scripts/gen_docs.py          # rewrite the usage blocks
    python scripts/gen_docs.py --check  # exit 1 when one is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "commands"
BEGIN = "<!-- usage: written by scripts/gen_docs.py from --help; do not edit -->"
END = "<!-- /usage -->"
COMMANDS = ("generate", "beam", "compare", "speculate", "bench", "explain", "presets")
WIDTH = 100


def help_text(command: str) -> str | None:
    """`genlab COMMAND --help` as plain text at WIDTH columns; None for a command this
    genlab does not have."""
    from typer.testing import CliRunner

    sys.path.insert(0, str(ROOT))
    from cli.main import app

    result = CliRunner().invoke(app, [command, "--help"], env={
        "COLUMNS": str(WIDTH), "TERMINAL_WIDTH": str(WIDTH), "NO_COLOR": "1",
        "_TYPER_FORCE_DISABLE_TERMINAL": "1"})
    if result.exit_code != 0:
        return None
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()).strip() + "\n"


def usage_block(command: str) -> str | None:
    text = help_text(command)
    return None if text is None else f"{BEGIN}\n```text\n{text}```\n{END}"


def updated(page: str, block: str) -> str:
    """`page` with its usage block replaced (appended when it has none)."""
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        return head + block + rest.split(END, 1)[1]
    return page.rstrip() + "\n\n## Usage\n\n" + block + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for command in COMMANDS:
        block = usage_block(command)
        if block is None:
            continue
        path = PAGES / f"{command}.md"
        page = path.read_text() if path.exists() else f"# genlab {command}\n"
        new = updated(page, block)
        if new != page:
            stale.append(path.name)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)} (run python scripts/gen_docs.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
