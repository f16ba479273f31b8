"""Turn genlib's domain errors into one red line on stderr and an exit code."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from genlib.errors import GenlabError

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> typer.Exit:
    from cli.render import error

    error(message)
    return typer.Exit(code)


def user_errors(command: F) -> F:
    """Decorator: GenlabError -> `error: ...` and its exit code (2 input, 1 runtime)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except GenlabError as exc:
            raise fail(str(exc), exc.exit_code) from None

    return wrapper  # type: ignore[return-value]
