"""Domain exceptions. Each message says what is wrong and how to fix it.

genlib raises these; only cli/ turns them into a one-line message and an exit code.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any


class GenlabError(Exception):
    """Base class for every error a user can cause or act on."""

    exit_code = 1


class UserInputError(GenlabError):
    """Bad input from the user (flags, presets, files): exit code 2."""

    exit_code = 2


class ConfigError(UserInputError):
    """A generation setting is unknown, of the wrong type, or out of range."""


class PresetError(UserInputError):
    """A preset cannot be found, parsed or validated. `quotes_file`: the message shows
    what a preset file holds (a key, a value, a YAML excerpt), which callers passing on
    messages to others (batch results) must not repeat."""

    def __init__(self, message: str, quotes_file: bool = False):
        super().__init__(message)
        self.quotes_file = quotes_file


class ModelLoadError(UserInputError):
    """A model or tokenizer cannot be loaded as asked (path, hub id, dtype, quantization)."""


class ContextLengthError(UserInputError):
    """Prompt plus new tokens do not fit in the model's positions."""


class ChatTemplateError(UserInputError):
    """Chat mode was asked for but the tokenizer has no chat template."""


class ChatRenderError(UserInputError):
    """The tokenizer's chat template refused the conversation (a system message it
    does not take, roles out of order) or cannot be rendered at all. `reason` is the
    template's own words, for a caller that words its own remedy (a batch line)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class CompileError(GenlabError):
    """torch.compile could not compile a step on this machine (its device, dtype and torch
    version): exit code 1, with the backend that runs without compiling."""


class GrammarTimeoutError(GenlabError):
    """A grammar took longer to compile than its grammar_timeout allows: exit code 1 (the
    grammar is valid; compiling it is what costs too much here)."""


class GenlabWarning(UserWarning):
    """Something in the user's input that genlib goes on with, but that they should know
    (a part of a regex the grammar library ignores): one line, said once. The CLI prints
    it as `warning: ...`; a library caller sees a Python warning."""


def show_genlab_warnings(say: Callable[[str], None]) -> None:
    """From now on, show each GenlabWarning by `say(message)` (the CLI's `warning:`
    line) in place of Python's file-and-line form; other warnings as Python shows
    them. A second call replaces the first's `say`."""
    python_s = getattr(warnings.showwarning, "python_s", warnings.showwarning)

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, GenlabWarning):
            say(str(message))
        else:
            python_s(message, category, *args, **kwargs)

    show.python_s = python_s  # type: ignore[attr-defined]
    warnings.showwarning = show


def not_one_of(name: str, value: object, choices: Iterable[str]) -> str:
    """The one wording of a value outside its choices, for every flag and setting:
    "--backend must be one of auto, transformers, ..., got 'fast'"."""
    return f"{name} must be one of {', '.join(choices)}, got {value!r}"


def unexpected(exc: BaseException) -> str:
    """The one-line wording of a fault that is a bug, not bad input: kept apart from
    every message a user's input can cause, so a report of one is a bug report."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"unexpected {type(exc).__name__}" + (f": {text}" if text else "")
