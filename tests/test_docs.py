"""The docs match the program: every command's page holds its current `--help`, and
the README's links lead to pages that exist."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_docs  # noqa: E402


@pytest.mark.parametrize("command", gen_docs.COMMANDS)
def test_each_command_page_holds_its_current_help(command):
    block = gen_docs.usage_block(command)
    if block is None:
        pytest.skip(f"no {command} command")
    page = (gen_docs.PAGES / f"{command}.md").read_text()
    assert block in page, f"docs/commands/{command}.md is out of date: run " \
                          f"python scripts/gen_docs.py"


def test_the_readme_links_lead_somewhere_and_it_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (ROOT / target).exists(), target
