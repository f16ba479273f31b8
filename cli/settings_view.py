"""`--show-settings` and the REPL's `/show`: every effective setting, its source, and
the model's generation_config.json value where it differs (genlab does not apply it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.table import Table

from cli.render import err, warn

if TYPE_CHECKING:
    from genlib.models.loading import LoadedModel
    from genlib.settings.config import GenerationSettings
    from genlib.settings.presets import Preset


def show_settings_table(settings: GenerationSettings, cli: Mapping[str, Any],
                        preset: Preset | None, lm: LoadedModel | None) -> None:
    """Print the table on stderr, then a warning per ignored setting."""
    from genlib.settings.provenance import model_generation_config, sources

    model_config = model_generation_config(lm.ref, lambda: lm.model) if lm is not None else {}
    rows = sources(settings, cli, preset, model_config)
    table = Table(title="effective settings", title_justify="left", show_edge=False)
    # Long values (--samplers' order, DRY's breakers, a JSON schema) fold inside their
    # own column; a source (a preset's path) wraps rather than taking the value's room
    # on an 80-column terminal.
    table.add_column("setting", no_wrap=True)
    table.add_column("value", min_width=12, max_width=48, overflow="fold")
    table.add_column("source", min_width=16, overflow="fold")
    with_model = any(r.model_value is not None for r in rows)
    if with_model:  # a column only where the model has a generation_config.json
        table.add_column("model's generation_config.json", min_width=12, overflow="fold")
    for r in rows:
        model_note = ""
        if r.model_value is not None and r.model_value != r.value:
            model_note = f"{r.model_value!r} (not applied)"
        elif r.model_value is not None:
            model_note = f"{r.model_value!r} (same)"
        cells = [r.name, repr(r.value), r.source, *([model_note] if with_model else [])]
        table.add_row(*cells, style="yellow" if r.ignored else None)
    err.print(table)
    if any(r.model_value is not None and r.model_value != r.value for r in rows):
        err.print("[dim]genlab does not apply a model's generation_config.json; pass a "
                  "value as a flag to use it.[/]")
    for r in rows:
        if r.ignored and r.name not in settings.unused:  # those were warned of already
            warn(f"{r.name} is ignored: it {r.ignored}")
