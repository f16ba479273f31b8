"""YAML decoding presets: built-ins shipped with genlab, plus the user's own.

A preset is a YAML mapping of generation settings (names as in `genlib.settings.config.SPECS`)
plus `name`, `description`, an optional `model` and an optional `extends: OTHER`.
Lookup order for a name: the user presets folder, then the built-ins. Anything with a
path separator or a `.yaml`/`.yml` suffix is read as a file path, except by
`load_named_preset`, for names from untrusted input (JSONL lines), which opens only the
presets of those two folders.

Limits checked before the work: a preset file of at most MAX_PRESET_BYTES, no YAML
aliases (an alias bomb expands to gigabytes from a few lines) and `extends` chains of at
most MAX_EXTENDS presets.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from genlib.errors import PresetError
from genlib.settings.config import (
    PRESET_META_KEYS,
    ConfigError,
    SettingsLoader,
    resolve_settings,
    shown,
    validate_settings,
)

if TYPE_CHECKING:
    from genlib.settings.config import GenerationSettings

SUFFIXES = (".yaml", ".yml")
MAX_PRESET_BYTES = 1 << 20  # a preset is a screenful of settings; 1 MiB is generous
MAX_EXTENDS = 32  # presets in one `extends` chain
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class Preset:
    """A loaded preset with `extends` applied: `settings` holds only generation settings,
    `set_by` the file along the `extends` chain that set each of them."""

    name: str
    path: Path
    description: str = ""
    model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    set_by: dict[str, Path] = field(default_factory=dict)


def builtin_dir() -> Path:
    """Folder of the built-in presets, in an installed package or in a checkout."""
    checkout = Path(__file__).resolve().parent.parent.parent / "presets"
    if checkout.is_dir():
        return checkout
    spec = importlib.util.find_spec("genlab_presets")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    return checkout


def user_dir() -> Path:
    """`$GENLAB_PRESETS_DIR`, else the platform's user config dir (`.../genlab/presets`)."""
    env = os.environ.get("GENLAB_PRESETS_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_config_dir

    return Path(user_config_dir("genlab")) / "presets"


def _looks_like_path(ref: str) -> bool:
    return ref.endswith(SUFFIXES) or os.sep in ref or "/" in ref


def _search_dirs() -> list[Path]:
    return [user_dir(), builtin_dir()]


def available_names() -> list[str]:
    names: set[str] = set()
    for folder in _search_dirs():
        if folder.is_dir():
            names.update(p.stem for p in folder.iterdir() if p.suffix in SUFFIXES)
    return sorted(names)


def find_preset(ref: str, relative_to: Path | None = None, skip: tuple[Path, ...] = ()
                ) -> Path:
    """Path of the preset `ref` (a name or a path); PresetError if there is none.

    A relative path is read against `relative_to` (the folder of the preset that
    extends it). Files in `skip` are passed over, so a user preset `creative.yaml` can
    `extends: creative` to build on the built-in of the same name.
    """
    if _looks_like_path(ref):
        path = Path(ref).expanduser()
        if not path.is_absolute() and relative_to is not None:
            path = relative_to / path
        if path.is_dir():
            raise PresetError(f"preset {ref} is a folder; give a preset file (.yaml) or "
                              f"a preset name")
        if not path.is_file():  # an extends path: where it was looked for
            raise PresetError(f"preset file {ref if relative_to is None else path} does "
                              f"not exist")
        return path
    found = _find_named(ref, skip)
    if found is None:
        raise _no_preset_named(ref, paths_allowed=True)
    return found


def _find_named(name: str, skip: tuple[Path, ...] = ()) -> Path | None:
    """The file of the preset `name` in the user's folder or the built-ins, if any."""
    for folder in _search_dirs():
        for suffix in SUFFIXES:
            candidate = folder / f"{name}{suffix}"
            try:
                found = candidate.is_file() and candidate.resolve() not in skip
                if not found and candidate.is_symlink() and not candidate.exists():
                    raise PresetError(f"preset {shown(name)} is {candidate}, a symbolic link "
                                      f"that leads nowhere; point it at a preset file or "
                                      f"remove it")
                if not found and candidate.is_dir():
                    raise PresetError(f"preset {shown(name)} is {candidate}, a folder, not a "
                                      f"preset file; rename or remove it")
            except OSError:  # a name too long for a file name: no preset has it
                continue
            if found:
                return candidate
    return None


def _no_preset_named(name: str, paths_allowed: bool) -> PresetError:
    """The error for an unknown name; it suggests a path only where one may be given
    (the user's own --preset, not an input line)."""
    from genlib.settings.config import closest_key

    hint = closest_key(name, available_names())
    extra = f" (did you mean {hint!r}?)" if hint else ""
    also = ", or pass a path to a .yaml file" if paths_allowed else ""
    return PresetError(f"no preset named {shown(name)}{extra}; `genlab presets list` shows "
                       f"them{also}")


class _NoAliasLoader(SettingsLoader):
    """The settings' YAML (safe, YAML 1.2's numbers) without aliases: `*name` may repeat
    a node exponentially often (the "billion laughs" bomb), and settings never need one."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in presets; write the value "
                "out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A mapping whose keys are unique, as YAML requires (PyYAML keeps the last)."""
        seen: set[tuple[type, Any]] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges a mapping in, as flatten_mapping does after this
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float)):
                continue  # a list or mapping as a key: the constructor refuses it
            if (type(key), key) in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice; keep one",
                    key_node.start_mark)
            seen.add((type(key), key))
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_PRESET_BYTES:
            raise PresetError(f"{path}: {size:,} bytes is larger than a preset may be "
                              f"({MAX_PRESET_BYTES:,} bytes)")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise PresetError(f"{path}: cannot read preset ({reason})") from None
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506  (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        reason = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line
        raise PresetError(f"{path}{where}: not valid YAML ({reason})",
                          quotes_file=True) from None
    except RecursionError:
        raise PresetError(f"{path}: nested too deeply to be a preset") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise PresetError(f"{path}: a preset must be a YAML mapping of settings, "
                          f"got {type(data).__name__}")
    return data


def load_preset(ref: str, _seen: tuple[Path, ...] = (), relative_to: Path | None = None
                ) -> Preset:
    """Load, validate and flatten a preset (its `extends` chain applied, child wins)."""
    try:
        path = find_preset(ref, relative_to, skip=_seen).resolve()
    except PresetError:
        path = find_preset(ref, relative_to).resolve()  # only the skipped file: a cycle
    if path in _seen:
        chain = " -> ".join(p.stem for p in (*_seen, path))
        raise PresetError(f"{path}: preset extends itself ({chain})")
    if len(_seen) >= MAX_EXTENDS:
        raise PresetError(f"{_seen[0]}: its extends chain is longer than {MAX_EXTENDS} "
                          f"presets; shorten it")
    data = _read_yaml(path)
    try:
        own = validate_settings(data, str(path), extra_keys=PRESET_META_KEYS)
    except ConfigError as exc:
        raise PresetError(str(exc), quotes_file=True) from None
    for key in ("name", "description", "model", "extends"):
        if key in own and own[key] is not None and not isinstance(own[key], str):
            raise PresetError(f"{path}: {key} must be a string, got {shown(own[key])}",
                              quotes_file=True)
    settings: dict[str, Any] = {}
    set_by: dict[str, Path] = {}
    model = description = None
    if own.get("extends"):
        parent = _load_parent(own["extends"], (*_seen, path))
        settings.update(parent.settings)
        set_by.update(parent.set_by)
        # a child without its own description says whose it shows
        model = parent.model
        description = f"(extends {own['extends']}) {parent.description}".rstrip()
    settings.update({k: v for k, v in own.items() if k not in PRESET_META_KEYS})
    set_by.update({k: path for k in own if k not in PRESET_META_KEYS})
    return Preset(
        name=own.get("name") or path.stem,
        path=path,
        description=own.get("description") or description or "",
        model=own.get("model") or model,
        settings=settings,
        set_by=set_by,
    )


def _load_parent(ref: str, chain: tuple[Path, ...]) -> Preset:
    """The preset `chain[-1]` extends; one that cannot be found is a PresetError naming
    the file whose `extends` names it (a relative path is read from that file's folder)."""
    child = chain[-1]
    try:
        find_preset(ref, child.parent)
    except PresetError as exc:
        raise PresetError(f"{child}: extends {shown(ref)}, which cannot be found: {exc}",
                          quotes_file=True) from None
    return load_preset(ref, chain, relative_to=child.parent)


def resolve_alone(preset: Preset) -> GenerationSettings:
    """The preset's settings on their own, genlab's defaults filled in (what `presets
    show` prints); PresetError naming its file when they do not combine (a preset that
    sets `num_return_sequences: 3` alone, meant to go with a sampling flag)."""
    try:
        return resolve_settings(None, preset.settings)
    except ConfigError as exc:
        raise PresetError(f"{preset.path}: {exc}", quotes_file=True) from None


def load_named_preset(name: str) -> Preset:
    """A preset by name only, found in the user's presets folder or the built-ins: for
    names from input that may not be the user's own (JSONL lines), which must not open
    any file they choose. A path, or a name that could step out of those folders, is a
    PresetError."""
    if not name or not set(name) <= NAME_CHARS or name.startswith(".") or \
            name.endswith(SUFFIXES):
        raise PresetError("preset must be the name of one of your presets or a built-in "
                          "(letters, digits, '-', '_', '.'; `genlab presets list` shows "
                          "them), not a path: input lines may not name files")
    if _find_named(name) is None:
        raise _no_preset_named(name, paths_allowed=False)
    return load_preset(name)


def list_presets() -> list[tuple[str, Preset | PresetError]]:
    """(name, preset) for every preset visible by name (user presets shadow built-ins of
    the same name), the name being what `--preset` takes; one that cannot be loaded, or
    whose settings do not combine on their own (`resolve_alone`), comes with its error
    instead, so one bad file hides nothing."""
    out: list[tuple[str, Preset | PresetError]] = []
    for name in available_names():
        try:
            preset = load_preset(name)
            resolve_alone(preset)
            out.append((name, preset))
        except PresetError as exc:
            out.append((name, exc))
    return out
