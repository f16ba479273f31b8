"""The `genlab` command's entry point: a run of a start daemon when one serves it
(cli/daemon_client.py), else the command itself, in this process (cli/main.py)."""

from __future__ import annotations

import sys


def main() -> None:
    from cli.daemon_client import run_in_daemon

    try:
        code = run_in_daemon()
    except KeyboardInterrupt:  # Ctrl-C before a run or this process took the command on
        if sys.stderr is not None:
            print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    if code is not None:
        sys.exit(code)
    from cli.main import run

    run()
