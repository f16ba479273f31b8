"""`genlab cache`: what genlab keeps in the user cache directory (the native kernel's
packed weights, one file per model, format and kernel layout; the kernel's builds),
with sizes; and `clear` to free it. Both start at once: no torch, no model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.errors import fail

app = typer.Typer(help="Show and free genlab's cache: packed weights and kernel builds.",
                  no_args_is_help=True)


def size_text(size: int) -> str:
    """Bytes as people read them: 1.32 GB, 69.2 MB, 812 kB, 40 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}" if size < 100 * scale else \
                f"{size / scale:.0f} {unit}"
    return f"{size} B"


@app.command("list")
def list_cache() -> None:
    """List the packed weights and the kernel's builds, with their sizes and the total."""
    from rich.markup import escape
    from rich.table import Table

    from cli.render import out
    from genlib import cachedirs
    from genlib.backends import weightcache

    entries = weightcache.entries()
    builds = [(p, _size(p) + _size(p.with_name(p.name + ".sha256")))
              for p in cachedirs.files(cachedirs.native()) if p.suffix == ".so"]
    if not entries and not builds:
        out.print(f"the cache is empty ({escape(str(cachedirs.root()))})")
        return
    table = Table(show_edge=False)
    for column in ("what", "model file or build", "format", "size", "state"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        state = "stale: the model file changed" if weightcache.stale(entry) else "current"
        table.add_row("weights", escape(str(entry.key.get("file", entry.path.name))),
                      escape(str(entry.key.get("weights", "?"))), size_text(entry.size), state)
    for build, size in builds:
        table.add_row("kernel", escape(build.name), "", size_text(size), "")
    out.print(table)
    total = sum(e.size for e in entries) + sum(size for _, size in builds)
    out.print(f"total {size_text(total)} in {escape(str(cachedirs.root()))}")


KernelsToo = Annotated[bool, typer.Option(
    "--kernels/--weights-only",
    help="Also remove the native kernel's builds (the next run rebuilds them, a few "
         "seconds).")]


@app.command("clear")
def clear(kernels: KernelsToo = True) -> None:
    """Delete the packed weights and the kernel's builds, and say how much was freed."""
    from cli.render import out
    from genlib import cachedirs
    from genlib.backends import weightcache

    doomed = [e.path for e in weightcache.entries()] + weightcache.leftovers()
    if kernels:
        doomed += cachedirs.files(cachedirs.native())
    freed = 0
    for path in doomed:
        freed += _remove(path)
    out.print(f"freed {size_text(freed)} ({len(doomed)} files) from {cachedirs.root()}")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remove(path: Path) -> int:
    """Delete one cache file; its size. A file that cannot be deleted stops the command
    with one line (exit 1): what was deleted before it stays deleted."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0  # another process cleared it first
    except OSError as error:
        raise fail(f"cannot delete {path} ({error.strerror}); check the folder's "
                   f"permissions", code=1) from None
    return size
