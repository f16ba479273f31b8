"""`genlab cache`: what genlab keeps in the user cache directory (the native kernel's
packed weights, one file per model, format and kernel layout; the tokenizers transformers
built, one per model folder; the kernel's builds), with sizes; and `clear` to free it.
Both start at once: no torch, no model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from cli import output
from cli.errors import fail, user_errors
from cli.output import Json, OutputFile, opened, sink

app = typer.Typer(help="Show and free genlab's cache: packed weights, tokenizers and "
                       "kernel builds.", no_args_is_help=True)


def size_text(size: int) -> str:
    """Bytes as people read them: 1.32 GB, 69.2 MB, 812 kB, 40 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}" if size < 100 * scale else \
                f"{size / scale:.0f} {unit}"
    return f"{size} B"


def _rows() -> list[dict[str, Any]]:
    """What the cache holds, a row a file: packed weights (with their model file, format
    and whether that file changed since), tokenizers (with their model folder) and the
    kernel's builds."""
    from genlib import cachedirs
    from genlib.backends import weightcache
    from genlib.models import tokenizer_cache

    rows = [{"kind": "weights", "name": str(e.key.get("file", e.path.name)),
             "format": e.key.get("weights"), "size": e.size,
             "stale": weightcache.stale(e)} for e in weightcache.entries()]
    rows += [{"kind": "tokenizer", "name": e.folder or e.path.name, "format": None,
              "size": e.size, "stale": e.stale} for e in tokenizer_cache.entries()]
    rows += [{"kind": "kernel", "name": p.name, "format": None,
              "size": _size(p) + _size(p.with_name(p.name + ".sha256")), "stale": None}
             for p in cachedirs.files(cachedirs.native()) if p.suffix == ".so"]
    return rows


@app.command("list")
@user_errors
def list_cache(as_json: Json = False, output_file: OutputFile = None) -> None:
    """List the cached weights, tokenizers and kernel builds, with sizes and the total."""
    from genlib import cachedirs

    target = sink(as_json, False, output_file)
    with _readable():
        rows, root = _rows(), str(cachedirs.root())
    with opened(target):
        if target.machine:
            target.json_document(output.document(
                "cache list", None, root=root, entries=rows,
                total_bytes=sum(row["size"] for row in rows)))
        else:
            show_list(rows, root)


def show_list(rows: list[dict[str, Any]], root: str) -> None:
    from rich.markup import escape
    from rich.table import Table

    from cli.render import out

    if not rows:
        out.print(f"the cache is empty ({escape(root)})")
        return
    table = Table(show_edge=False)
    for column in ("what", "model file or build", "format", "size", "state"):
        table.add_column(column, overflow="fold")
    for row in rows:
        state = "" if row["stale"] is None else "stale" if row["stale"] else "current"
        table.add_row(row["kind"], escape(row["name"]), escape(row["format"] or ""),
                      size_text(row["size"]), state)
    out.print(table)
    out.print(f"total {size_text(sum(row['size'] for row in rows))} in {escape(root)}")
    if any(row["stale"] for row in rows):
        out.print("stale: its model's files changed since it was made; the next load makes "
                  "it again (`genlab cache clear` frees it now)", soft_wrap=False)


KernelsToo = Annotated[bool, typer.Option(
    "--kernels/--weights-only",
    help="Remove the native kernel's builds too (the default; the next run rebuilds "
         "them, a few seconds), or keep them and remove the rest.")]


@app.command("clear")
@user_errors
def clear(kernels: KernelsToo = True, as_json: Json = False,
          output_file: OutputFile = None) -> None:
    """Delete the cached weights, tokenizers and kernel builds; say how much was freed."""
    from cli.render import counted, out
    from genlib import cachedirs
    from genlib.backends import weightcache
    from genlib.models import tokenizer_cache

    target = sink(as_json, False, output_file)
    with _readable():
        doomed = [e.path for e in weightcache.entries()] + weightcache.leftovers() + \
            [e.path for e in tokenizer_cache.entries()] + tokenizer_cache.leftovers()
        if kernels:
            doomed += cachedirs.files(cachedirs.native())
    with opened(target):
        freed = sum(_remove(path) for path in doomed)
        root = str(cachedirs.root())
        if target.machine:
            target.json_document(output.document("cache clear", None, root=root,
                                                 freed_bytes=freed, files=len(doomed)))
        else:
            out.print(f"freed {size_text(freed)} ({counted(len(doomed), 'file')}) from "
                      f"{root}")


@contextmanager
def _readable() -> Iterator[None]:
    """A cache folder this user may not read stops the command with one line (exit 1)."""
    from genlib import cachedirs

    try:
        yield
    except PermissionError as exc:
        raise fail(f"cannot read {exc.filename or cachedirs.root()} (permission denied); "
                   f"give yourself access (chmod -R u+rwX {cachedirs.root()})", 1) from None


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
