"""Where genlab caches what it makes once (nothing else: no torch, quick to import):
under the user cache directory (platformdirs: `$XDG_CACHE_HOME/genlab` or
`~/.cache/genlab` on Linux), the native kernel's builds (`native/`) and the kernel's
packed weights (`weights/`), and the tokenizers transformers built (`tokenizers/`).
`genlab cache` lists and clears them."""

from __future__ import annotations

from pathlib import Path


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
