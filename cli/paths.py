"""The one check of a file a command will write (-o/--output, --html, --csv, --plot,
--markdown, a batch's --output), made before the model loads, so a path that cannot be
written costs no work: one line naming the flag, the path and why, exit 2."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from cli.errors import fail


def check_output_path(path: Path, flag: str) -> None:
    """Exit 2 with one line unless `path` can be written: an existing file must be
    writable (a FIFO or a device is taken as it is), a new one must be creatable there,
    which is tried (and undone) rather than guessed, since permission bits do not tell
    a root user, a read-only mount or /proc apart."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise fail(f"{flag} {path}: {_reason(path, exc)}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise fail(f"{flag} {path} is a directory; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        return  # /dev/null, a FIFO, a terminal: opened when written, never probed
    try:
        _probe(path, exists=mode is not None)
    except OSError as exc:
        raise fail(f"{flag} {path}: {_reason(path, exc)}") from None


def _probe(path: Path, exists: bool) -> None:
    """Open an existing file for writing without changing it, or create the new file
    (exclusively, so nothing of anyone else's is touched) and remove it again."""
    if exists:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        return
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    os.unlink(path)


def _reason(path: Path, exc: OSError) -> str:
    """Why `path` cannot be written, and what to do, in words."""
    folder = path.parent
    if exc.errno == errno.ENAMETOOLONG:
        return (f"the name is too long ({len(os.fsencode(path.name))} bytes; this file "
                f"system allows {_name_max(folder)}); give a shorter name")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        if folder.exists() and not folder.is_dir():
            return f"{folder} is a file, not a folder; pick another path"
        if not folder.is_dir():
            return f"folder {folder} does not exist; create it or pick another path"
        return f"cannot create a file in {folder}; pick another path"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "cannot be written (no permission); pick a writable path"
    if exc.errno == errno.EROFS:
        return "cannot be written (read-only file system); pick another path"
    return f"cannot be written ({exc.strerror or exc}); pick another path"


def _name_max(folder: Path) -> int | str:
    try:
        return os.pathconf(folder if folder.is_dir() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return "fewer"
