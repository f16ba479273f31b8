"""`genlab presets`: list the presets and show one fully resolved."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.errors import user_errors

app = typer.Typer(help="List and inspect decoding presets.", no_args_is_help=True)


@app.command("list")
@user_errors
def list_() -> None:
    """Name, strategy and description of every preset (built-in and yours)."""
    from rich.markup import escape
    from rich.table import Table

    from cli.render import out
    from genlib.config import resolve_settings
    from genlib.errors import PresetError
    from genlib.presets import builtin_dir, list_presets, user_dir

    table = Table(title=None, show_edge=False)
    for column in ("name", "strategy", "description", "source"):
        table.add_column(column, overflow="fold")
    for name, preset in list_presets():
        if isinstance(preset, PresetError):
            table.add_row(name, "[red]error[/]", escape(str(preset)), "")
            continue
        strategy = resolve_settings(None, preset.settings).strategy
        source = "built-in" if preset.path.parent == builtin_dir().resolve() else str(preset.path)
        table.add_row(preset.name, strategy, preset.description, source)
    out.print(table)
    out.print(f"[dim]your presets folder: {user_dir()}[/]")


@app.command("show")
@user_errors
def show(name: Annotated[str, typer.Argument(help="Preset name or path to a .yaml file.")]
         ) -> None:
    """The fully resolved settings of a preset (defaults filled in), as YAML."""
    import yaml

    from genlib.config import resolve_settings
    from genlib.presets import load_preset

    preset = load_preset(name)
    resolved = {"name": preset.name, "description": preset.description}
    if preset.model:
        resolved["model"] = preset.model
    resolved.update(resolve_settings(None, preset.settings).to_dict())
    typer.echo(yaml.safe_dump(resolved, sort_keys=False, allow_unicode=True), nl=False)


@app.command("keys")
def keys() -> None:
    """Every setting a preset (or a flag, a JSONL line, /set) may hold."""
    from rich.table import Table

    from cli.render import out
    from genlib.config import SPECS

    table = Table(show_edge=False)
    for column in ("key", "default"):  # each key and its default stay whole on one line
        table.add_column(column, no_wrap=True)
    for column in ("allowed", "meaning"):
        table.add_column(column, overflow="fold", ratio=1)
    for key, spec in SPECS.items():
        table.add_row(key, repr(spec.default), spec.allowed or spec.kind, spec.help)
    out.print(table)
