"""The `genlab` command: a Typer app with one module per subcommand.

Nothing here imports torch or transformers; subcommands import them when they run.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from types import FrameType
from typing import Annotated

import typer

from cli import beam as beam_cmd
from cli import bench as bench_cmd
from cli import cache as cache_cmd
from cli import compare as compare_cmd
from cli import daemon as daemon_cmd
from cli import explain as explain_cmd
from cli import generate as generate_cmd
from cli import presets as presets_cmd
from cli import speculate as speculate_cmd

app = typer.Typer(
    name="genlab",
    help="Generate text with language models and see how decoding strategies behave.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion, Typer's own
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from cli.errors import STDOUT_CLOSED, fail
        from cli.output import version
        from cli.render import out

        if sys.stdout is None:  # started with stdout closed (`>&-`)
            raise fail(STDOUT_CLOSED, 2)
        out.print(f"genlab {version()}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option(
        "--version", "-V", is_eager=True, callback=_print_version,
        help="Print genlab's version and exit.")] = False,
) -> None:
    """Generate text with language models and see how decoding strategies behave."""
    from cli.render import warn
    from genlib.errors import show_genlab_warnings

    show_genlab_warnings(warn)


app.command("generate")(generate_cmd.generate)
app.command("beam")(beam_cmd.beam)
app.command("compare")(compare_cmd.compare)
app.command("bench")(bench_cmd.bench)
app.command("speculate")(speculate_cmd.speculate)
app.command("explain")(explain_cmd.explain)
app.add_typer(presets_cmd.app, name="presets")
app.add_typer(cache_cmd.app, name="cache")
app.add_typer(daemon_cmd.app, name="daemon")


def in_finalizer(frame: FrameType | None) -> bool:
    """Whether a signal handler called at `frame` runs inside an object's `__del__` (the
    garbage collector's, at any moment), where an exception it raises would be ignored."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def run() -> None:
    """Console-script entry point, and the process's rules for every command: a reader of
    stdout that goes away (`genlab beam ... | head`) ends the command quietly with
    BROKEN_PIPE (141); SIGTERM (`timeout`, `kill`) stops it as Ctrl-C does, so what it
    produced is still written and documents stay whole, then ends it with TERMINATED (143)."""
    from rich.console import Console

    from cli.errors import (
        INTERRUPTED,
        TERMINATED,
        fail,
        is_usage_error,
        on_broken_pipe,
        reader_gone,
        stderr_to_devnull,
        usage_error,
        write_failure,
    )

    # Rich's hook for a closed pipe (its own exits with 1), set on the class so that the
    # consoles Typer makes for --help follow it too.
    Console.on_broken_pipe = on_broken_pipe  # type: ignore[method-assign]
    terminated = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal terminated
        if in_finalizer(frame):  # Python ignores an exception a finalizer raises
            threading.Timer(0.01, signal.raise_signal, (signal.SIGTERM,)).start()
            return
        terminated = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        raise KeyboardInterrupt  # the loops keep what they produced, as for Ctrl-C

    signal.signal(signal.SIGTERM, on_sigterm)
    if sys.stdin is None:  # started with stdin closed (`<&-`): read it as empty
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 (the process's)
    stderr_to_devnull()
    try:
        # Not standalone, so that usage errors come here to be one line; a command's
        # typer.Exit comes back as its code.
        code = app(standalone_mode=False) or 0
    except typer.Abort:
        code = fail("aborted", 1).exit_code
    except KeyboardInterrupt:  # before a command ran (Typer building the command line)
        code = fail("interrupted", INTERRUPTED).exit_code
    except SystemExit as exc:
        code = exc.code
    except OSError as exc:  # --help and --version write outside any command's guard
        failure = write_failure(exc)
        if failure is None:
            raise
        reader_gone(sys.stdout)  # the exit's flush of what stdout holds goes nowhere
        code = failure.exit_code
    except Exception as exc:
        if not is_usage_error(exc):
            raise
        code = exc.exit_code  # type: ignore[attr-defined]
        if type(exc).__name__ != "NoArgsIsHelpError":  # `genlab presets`: help, shown
            usage_error(exc)
    # Interpreter shutdown garbage-collects every object torch and transformers created,
    # a wait after the work is done; frozen objects are left to the process exit.
    # Files, atexit handlers and stream flushing run as usual.
    gc.freeze()
    code = TERMINATED if terminated and code == INTERRUPTED else code
    _exit_past_a_running_compile(code)
    raise SystemExit(code)


def _exit_past_a_running_compile(code: object) -> None:
    """End the process now, with `code`, while a grammar compile it gave up on (Ctrl-C,
    SIGTERM, --grammar-timeout) still runs on its worker thread: that C++ call cannot be
    stopped, and returning into an interpreter that has shut down aborts the process.
    The command's own files are closed by now; the standard streams are flushed here."""
    from cli.errors import flush_standard_streams

    bounded = sys.modules.get("genlib.sampling.bounded")
    if bounded is None or not bounded.running():
        return
    flush_standard_streams()
    os._exit(code if isinstance(code, int) else 1)

if __name__ == "__main__":
    run()
