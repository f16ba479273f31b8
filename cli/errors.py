"""Turn genlib's domain errors into one red line on stderr and an exit code."""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, NoReturn, TypeVar

import typer

from genlib.errors import GenlabError

if TYPE_CHECKING:
    from rich.console import Console

F = TypeVar("F", bound=Callable[..., Any])

INTERRUPTED = 130  # the exit status of a command Ctrl-C stopped (128 + SIGINT)
BROKEN_PIPE = 141  # the exit status when the reader of stdout went away (128 + SIGPIPE)
TERMINATED = 143  # the exit status of a command SIGTERM stopped (128 + SIGTERM)


STDOUT_CLOSED = ("standard output is closed; redirect it to a file (> out.txt) or to "
                 "/dev/null to discard it")


def exit_code(reasons: list[str], max_new_tokens: int, interrupted: bool) -> int:
    """A run's exit status from its outputs' finish reasons: INTERRUPTED after Ctrl-C or
    SIGTERM; 1 when an output is not valid under its grammar (`warn_incomplete` warns);
    else 0."""
    from cli.render import warn_incomplete

    if interrupted:
        return INTERRUPTED
    return 1 if warn_incomplete(reasons, max_new_tokens) else 0


def _stdout_open() -> bool:
    try:
        os.fstat(1)
    except OSError:
        return False
    return True


def _writable(fd: int) -> bool:
    try:
        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except OSError:
        return False


def stderr_to_devnull() -> None:
    """Started with stderr closed (`2>&-`): put /dev/null on descriptor 2 and make it
    sys.stderr, so that messages go nowhere. Else the next file opened would take
    descriptor 2, and C libraries' logs (xgrammar's) would be written into it. A
    descriptor 2 open only for reading is a file that took the closed stderr's place
    before Python started (a launcher script's own), and is replaced too."""
    if sys.stderr is not None and _writable(2):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    if null != 2:
        os.dup2(null, 2)
        os.close(null)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115


def fail(message: str, code: int = 2) -> typer.Exit:
    from cli.render import error

    error(message)
    return typer.Exit(code)


def user_errors(command: F) -> F:
    """Decorator: GenlabError -> `error: ...` and its exit code (2 input, 1 runtime);
    Ctrl-C that no loop handled -> `error: interrupted` and INTERRUPTED; any other
    exception -> one `error: unexpected ...` line and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if sys.stdout is None:  # started with stdout closed (`>&-`): output would vanish
            raise fail(STDOUT_CLOSED, 2)
        try:
            return command(*args, **kwargs)
        except GenlabError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except UnicodeEncodeError as exc:
            if exc.encoding.lower().replace("-", "") in ("utf8", "utf16", "utf32"):
                raise _unexpected(exc) from None  # no character it lacks: a bug
            raise fail(f"the output holds a character ({exc.object[exc.start:exc.end]!r}) "
                       f"that the output encoding {exc.encoding} cannot write; set "
                       f"PYTHONIOENCODING=utf-8 or use a UTF-8 locale", 1) from None
        except KeyboardInterrupt:  # outside the loops that keep what they produced
            raise fail("interrupted", INTERRUPTED) from None
        except BrokenPipeError:  # `genlab generate ... | head -c 100`
            reader_gone(sys.stdout)
            raise typer.Exit(BROKEN_PIPE) from None
        except OSError as exc:
            raise (write_failure(exc) or _unexpected(exc)) from None
        except Exception as exc:
            if type(exc).__module__.startswith(("typer", "click")):
                raise  # Typer's own exits and usage errors
            raise _unexpected(exc) from None

    return wrapper  # type: ignore[return-value]


def output_lost(exc: BaseException) -> bool:
    """Whether `exc` is a write that failed because the output has nowhere to go: its
    reader went away, stdout is closed, or the device is full."""
    return isinstance(exc, BrokenPipeError) or (isinstance(exc, OSError) and (
        exc.errno in (errno.ENOSPC, errno.EDQUOT)
        or (exc.errno == errno.EBADF and not _stdout_open())))


def write_failure(exc: OSError) -> typer.Exit | None:
    """The one line and exit of a write that failed because stdout is closed or the
    device is full (said now); None for any other OSError."""
    if exc.errno == errno.EBADF and not _stdout_open():
        return fail(STDOUT_CLOSED, 2)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" {exc.filename}" if exc.filename else ""
        return fail(f"cannot write{where}: no space left on the device; free some space, "
                    f"or write elsewhere", 1)
    return None


def flush_standard_streams() -> None:
    """Flush stdout and stderr before the process ends past the interpreter's own exit
    (`os._exit`); one that cannot be written any more is left as it is."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def reader_gone(stream: IO[str]) -> None:
    """The reader of `stream` went away, so the command stops quietly, as shell tools
    do, with the status SIGPIPE would give (BROKEN_PIPE): later writes to the stream (the
    exit's flush) go nowhere instead of raising again."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a file (a test's buffer): nothing to redirect
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def on_broken_pipe(console: Console) -> NoReturn:
    """Rich's hook for a console whose reader went away (`genlab beam ... | head`), where
    Rich's own exits with 1: the same quiet BROKEN_PIPE as any other write. SystemExit,
    so that no `except Exception` on the way mistakes it for a failure."""
    console.quiet = True
    reader_gone(console.file)
    raise SystemExit(BROKEN_PIPE)


def is_usage_error(exc: BaseException) -> bool:
    """Whether `exc` is Typer's error for a command line it could not take (`-n abc`,
    `--frob`, a missing argument): Click's classes, which Typer vendors from 0.26."""
    return (type(exc).__module__.startswith(("typer", "click"))
            and hasattr(exc, "format_message") and isinstance(getattr(exc, "exit_code", None), int))


def usage_error(exc: Exception) -> typer.Exit:
    """One `error:` line for a usage error, like every other error, naming the help to
    read, in place of Typer's boxed usage."""
    message = exc.format_message().replace("\n", " ").rstrip(".")  # type: ignore[attr-defined]
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    ctx = getattr(exc, "ctx", None)
    if ctx is not None and ctx.command.get_help_option(ctx) is not None:
        message += f"; see '{ctx.command_path} {ctx.help_option_names[0]}'"
    return fail(message, exc.exit_code)  # type: ignore[attr-defined]


def _unexpected(exc: Exception) -> typer.Exit:
    """A bug or an environment failure: still one line for the user, and the traceback
    on request (GENLAB_DEBUG=1) for a bug report."""
    if os.environ.get("GENLAB_DEBUG"):
        raise exc
    from genlib.errors import unexpected

    return fail(f"{unexpected(exc)} (run with GENLAB_DEBUG=1 for the traceback)", 1)
