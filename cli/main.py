"""The `genlab` command: a Typer app with one module per subcommand.

Nothing here imports torch or transformers; subcommands import them when they run.
"""

from __future__ import annotations

import gc

import typer

from cli import beam as beam_cmd
from cli import bench as bench_cmd
from cli import compare as compare_cmd
from cli import explain as explain_cmd
from cli import generate as generate_cmd
from cli import presets as presets_cmd
from cli import speculate as speculate_cmd

app = typer.Typer(
    name="genlab",
    help="Generate text with language models and see how decoding strategies behave.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("generate")(generate_cmd.generate)
app.command("beam")(beam_cmd.beam)
app.command("compare")(compare_cmd.compare)
app.command("bench")(bench_cmd.bench)
app.command("speculate")(speculate_cmd.speculate)
app.command("explain")(explain_cmd.explain)
app.add_typer(presets_cmd.app, name="presets")


def run() -> None:
    """Console-script entry point."""
    try:
        app()
    finally:
        # Interpreter shutdown garbage-collects every object torch and transformers
        # created, about half a second after the work is done; frozen objects are left to
        # the process exit. Files, atexit handlers and stream flushing run as usual.
        gc.freeze()


if __name__ == "__main__":
    run()
