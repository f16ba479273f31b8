"""Test aid: run the suite as if extras were not installed.

With `GENLAB_TEST_WITHOUT=xgrammar,ray,matplotlib`, importing any of the named top-level
modules fails with ModuleNotFoundError (and `importlib.util.find_spec` returns None), as
on an install without the `grammar`, `ray` and `plot` extras. tests/conftest.py applies
it to the test process and puts this folder on PYTHONPATH, so that the CLI subprocesses
the tests start load it too (Python imports `sitecustomize` at start-up)."""

from __future__ import annotations

import os
import sys

VARIABLE = "GENLAB_TEST_WITHOUT"


def blocked() -> list[str]:
    """The module names GENLAB_TEST_WITHOUT lists."""
    return [name.strip() for name in os.environ.get(VARIABLE, "").split(",") if name.strip()]


def block() -> None:
    """Make each listed module unimportable (None in sys.modules stops an import)."""
    for name in blocked():
        sys.modules[name] = None  # type: ignore[assignment]


block()
