"""The `genlab` command's entry point: a run of a start daemon when one serves it
(cli/daemon_client.py), else the command itself, in this process (cli/main.py)."""

from __future__ import annotations

import sys


def main() -> None:
    from cli.daemon_client import run_in_daemon

    code = run_in_daemon()
    if code is not None:
        sys.exit(code)
    from cli.main import run

    run()
