"""`genlab presets`: list the presets, show one fully resolved, list the keys a preset
may hold; each as a table (YAML for `show`) or, with --json, one document of the JSON
contract (docs/output.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli import output
from cli.errors import user_errors
from cli.options import complete_preset
from cli.output import Json, OutputFile, opened, sink

if TYPE_CHECKING:
    from genlib.errors import PresetError
    from genlib.settings.presets import Preset

app = typer.Typer(help="List and inspect decoding presets.", no_args_is_help=True)


def source_of(path: Path) -> str:
    """Where a preset file lives: `built-in`, `user` (your presets folder) or `file`
    (a path given on the command line)."""
    from genlib.settings.presets import builtin_dir, user_dir

    if path.parent == builtin_dir().resolve():
        return "built-in"
    if path.parent == user_dir().expanduser().resolve():
        return "user"
    return "file"


# --- list -------------------------------------------------------------------------------

def list_row(name: str, preset: Preset | PresetError) -> dict[str, Any]:
    """One preset of `presets list --json`, under `name`, what --preset takes (a file's
    `name:` may differ); one that cannot be loaded has its `error`."""
    from genlib.errors import PresetError
    from genlib.settings.presets import resolve_alone

    if isinstance(preset, PresetError):
        return {"name": name, "description": None, "strategy": None, "model": None,
                "source": None, "path": None, "error": str(preset)}
    return {"name": name, "description": preset.description,
            "strategy": resolve_alone(preset).strategy,
            "model": preset.model, "source": source_of(preset.path),
            "path": str(preset.path), "error": None}


def list_document(presets: list[tuple[str, Preset | PresetError]]) -> dict[str, Any]:
    from genlib.settings.presets import user_dir

    return output.document("presets list", None, user_dir=str(user_dir()),
                           presets=[list_row(name, p) for name, p in presets])


def show_list(presets: list[tuple[str, Preset | PresetError]]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from cli.render import out
    from genlib.errors import PresetError
    from genlib.settings.presets import resolve_alone, user_dir

    table = Table(title=None, show_edge=False)
    for column in ("name", "strategy", "description", "source"):
        table.add_column(column, overflow="fold")
    for name, preset in presets:
        if isinstance(preset, PresetError):
            table.add_row(name, "[red]error[/]", escape(str(preset)), "")
            continue
        strategy = resolve_alone(preset).strategy
        source = "built-in" if source_of(preset.path) == "built-in" else str(preset.path)
        table.add_row(name, strategy, preset.description, source)
    out.print(table)
    out.print(f"[dim]your presets folder: {user_dir()}[/]")


@app.command("list")
@user_errors
def list_(as_json: Json = False, output_file: OutputFile = None) -> None:
    """Name, strategy and description of every preset (built-in and yours)."""
    from genlib.settings.presets import list_presets

    target = sink(as_json, False, output_file)
    presets = list_presets()
    with opened(target):
        if target.machine:
            target.json_document(list_document(presets))
        else:
            show_list(presets)


# --- show -------------------------------------------------------------------------------

def show_document(preset: Preset) -> dict[str, Any]:
    """`presets show --json`: the preset, its resolved settings, and which file along
    its `extends` chain set each setting it holds (the others are genlab's defaults)."""
    from genlib.settings.presets import resolve_alone

    described = {"name": preset.name, "description": preset.description,
                 "source": source_of(preset.path), "path": str(preset.path)}
    return output.document(
        "presets show", preset.model, preset=described,
        settings=resolve_alone(preset).to_dict(),
        set_by={key: str(path) for key, path in preset.set_by.items()})


def has_control(text: str) -> bool:
    """Whether `text` holds a control character (a newline, a tab, ...)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def show_yaml(preset: Preset) -> str:
    """The resolved preset as YAML; a string with a control character (DRY's "\\n"
    sequence breaker) double-quoted with escapes, not a block of blank lines."""
    import yaml

    from genlib.settings.presets import resolve_alone

    class Dumper(yaml.SafeDumper):
        pass

    def string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
        style = '"' if has_control(text) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)

    Dumper.add_representer(str, string)
    resolved = {"name": preset.name, "description": preset.description}
    if preset.model:
        resolved["model"] = preset.model
    resolved.update(resolve_alone(preset).to_dict())
    return yaml.dump(resolved, Dumper=Dumper, sort_keys=False, allow_unicode=True,
                     width=72)  # a long description folds within 80 columns


@app.command("show")
@user_errors
def show(name: Annotated[str, typer.Argument(help="Preset name or path to a .yaml file.",
                                             autocompletion=complete_preset)],
         as_json: Json = False, output_file: OutputFile = None) -> None:
    """The fully resolved settings of a preset (defaults filled in), as YAML."""
    from genlib.settings.presets import load_preset, resolve_alone

    target = sink(as_json, False, output_file)
    preset = load_preset(name)
    resolve_alone(preset)  # settings that do not combine: refused before -o is opened
    with opened(target):
        if target.machine:
            target.json_document(show_document(preset))
        else:
            typer.echo(show_yaml(preset), nl=False)


# --- keys -------------------------------------------------------------------------------

def keys_document() -> dict[str, Any]:
    """`presets keys --json`: every setting with its type, default (as `settings` holds
    it; null where it has none or is inferred), range and meaning."""
    from genlib.settings.config import SPECS, GenerationSettings

    defaults = GenerationSettings().to_dict()
    keys = [{"key": key, "type": spec.kind,
             "default": None if spec.default is None else defaults[key],
             "nullable": spec.optional, "allowed": spec.allowed or None,
             "choices": list(spec.choices), "meaning": spec.help}
            for key, spec in SPECS.items()]
    return output.document("presets keys", None, keys=keys)


def show_keys() -> None:
    from rich.table import Table

    from cli.render import out
    from genlib.settings.config import SPECS

    table = Table(show_edge=False)
    table.add_column("key", no_wrap=True)  # each key stays whole on one line
    # A long default (a list) folds rather than take the meaning's room.
    table.add_column("default", overflow="fold", max_width=14)
    table.add_column("allowed", overflow="fold", max_width=16)
    table.add_column("meaning", overflow="fold", ratio=1)
    for key, spec in SPECS.items():
        table.add_row(key, repr(spec.default), spec.allowed or spec.kind, spec.help)
    out.print(table)


@app.command("keys")
@user_errors
def keys(as_json: Json = False, output_file: OutputFile = None) -> None:
    """Every setting a preset (or a flag, a JSONL line, /set) may hold."""
    target = sink(as_json, False, output_file)
    with opened(target):
        if target.machine:
            target.json_document(keys_document())
        else:
            show_keys()
