"""Where each effective setting came from: the command line, a preset (the file that
set it, along its `extends` chain), or genlab's default; and what the model's
`generation_config.json` would have set.

genlab does not apply a model's `generation_config.json` sampling defaults: the
precedence is flag > preset > genlab's default, so one command means the same thing
on every model. `sources` reports the model's values beside the effective ones so the
difference is visible (and one flag away).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genlib.settings.config import SPECS, GenerationSettings
from genlib.settings.presets import Preset

CLI = "command line"
DEFAULT = "genlab default"
DERIVED = "derived"  # strategy/do_sample when inferred from the other settings
BEAM_ONLY = ("num_beams", "length_penalty", "early_stopping", "num_beam_groups",
             "diversity_penalty", "force_words", "force_any")


@dataclass(frozen=True)
class Source:
    """One setting: its effective value, where it came from, the model's
    generation_config.json value for it (None: the file does not set it) and a warning
    when the strategy ignores it."""

    name: str
    value: Any
    source: str
    model_value: Any = None
    ignored: str = ""


def model_generation_config(model_ref: str, model: Callable[[], Any] | None = None
                            ) -> dict[str, Any]:
    """The settings a model's generation_config.json names (a local folder's file, else
    the `generation_config` of `model()`, called only then: a quickly loaded model
    builds its transformers model on first access); {} when there is none. `model_ref`
    as the user gave it: a built-in model's name or `~/...` is found where loading
    found it."""
    from genlib.models.loading import model_source

    path = Path(model_source(model_ref)) / "generation_config.json"
    data: dict[str, Any] = {}
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
    elif model is not None:
        config = getattr(model(), "generation_config", None)
        data = config.to_diff_dict() if hasattr(config, "to_diff_dict") else {}
    return {k: v for k, v in data.items() if k in SPECS}


def sources(settings: GenerationSettings, cli: Mapping[str, Any], preset: Preset | None,
            model_config: Mapping[str, Any]) -> list[Source]:
    """Every setting of `settings` with its source (see the module doc)."""
    files = preset.set_by if preset is not None else {}
    out = []
    for name in SPECS:
        value = getattr(settings, name)
        if name in cli and cli[name] is not None:
            where = CLI
        elif name in files:
            where = f"preset {preset.name if preset else ''} ({files[name]})"
        elif name in ("strategy", "do_sample"):
            where = DERIVED
        else:
            where = DEFAULT
        out.append(Source(name, value, where, model_config.get(name),
                          _ignored(settings, name, where)))
    return out


def _ignored(settings: GenerationSettings, name: str, where: str) -> str:
    """Why the strategy ignores an explicitly given setting ('' when it does not)."""
    if where in (DEFAULT, DERIVED):
        return ""
    if name in settings.unused:
        return f"only applies when sampling (strategy {settings.strategy})"
    if name in BEAM_ONLY and settings.strategy != "beam":
        return f"only applies to beam search (strategy {settings.strategy})"
    return ""
