"""What every generating subcommand does first: read the preset, merge settings
(flag > preset > defaults) and load the model once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genlib.config import GenerationSettings, resolve_settings
from genlib.presets import Preset, load_preset

if TYPE_CHECKING:
    from genlib.models import LoadedModel


@dataclass
class ModelFlags:
    model: str | None
    device: str = "auto"
    dtype: str = "auto"
    quantize: str = "none"
    trust_remote_code: bool = False


def settings_for(preset_ref: str | None, flags: dict[str, Any]
                 ) -> tuple[GenerationSettings, Preset | None]:
    preset = load_preset(preset_ref) if preset_ref else None
    settings = resolve_settings(flags, preset.settings if preset else None)
    from cli.render import warn_unused

    warn_unused(settings)
    return settings, preset


def load(flags: ModelFlags, preset: Preset | None = None, quick: bool = False) -> LoadedModel:
    """The model the flags and preset name; `quick` starts without transformers where
    the checkpoint allows (genlib.quickload), for commands that mostly decode one row."""
    from genlib.models import ModelSpec, load_model, resolve_model_ref

    ref = resolve_model_ref(flags.model, preset.model if preset else None)
    spec = ModelSpec(ref=ref, device=flags.device, dtype=flags.dtype, quantize=flags.quantize,
                     trust_remote_code=flags.trust_remote_code)
    with loading(ref):
        return load_model(spec, quick=quick)


@contextmanager
def loading(ref: str) -> Iterator[None]:
    """A "loading MODEL" spinner on stderr while a model loads (seconds), where stderr
    is a terminal; nothing in pipes and logs."""
    from cli.render import err

    if not err.is_terminal:
        yield
        return
    from rich.errors import LiveError
    from rich.markup import escape

    status = err.status(f"loading {escape(ref)}", spinner="dots")
    try:
        status.start()
    except LiveError:  # Rich before 14 draws one live display at a time (bench's bar)
        yield
        return
    try:
        yield
    finally:
        status.stop()
