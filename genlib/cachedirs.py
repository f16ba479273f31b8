"""Where genlab caches what it makes once (nothing else: no torch, quick to import):
under the user cache directory (platformdirs: `$XDG_CACHE_HOME/genlab` or
`~/.cache/genlab` on Linux), the native kernel's builds (`native/`) and the kernel's
packed weights (`weights/`), and the tokenizers transformers built (`tokenizers/`).
`genlab cache` lists and clears them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def root() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("genlab"))


def native() -> Path:
    return root() / "native"


def weights() -> Path:
    return root() / "weights"


def tokenizers() -> Path:
    return root() / "tokenizers"


def files(folder: Path) -> list[Path]:
    """The plain files in `folder`, sorted (none when it does not exist)."""
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


@contextmanager
def written_whole(path: Path, mode: int | None = None) -> Iterator[BinaryIO]:
    """A file for `path`'s new contents, written under a temporary name beside it
    (`.NAME.*.tmp`) and renamed into place when the block ends without an error: a reader
    never sees half a file, and two writers at once each leave a whole one. The temporary
    file is gone either way. Its permissions: `mode`, or the owner's alone (a cache's).
    OSError where the folder cannot be made or written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(handle, mode)
        with os.fdopen(handle, "wb") as file:
            yield file
        os.replace(temporary, path)
    finally:
        Path(temporary).unlink(missing_ok=True)
