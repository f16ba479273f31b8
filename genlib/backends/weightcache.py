"""Packed weights cached on disk: made once per model, format and kernel layout, mapped
with mmap on every later start instead of packed again.

    tensors = cached(entry, key, build, notify)  # build() -> dict[str, Tensor], or the cache's

Knows nothing of formats: `build` returns named tensors of any dtype and shape, stored as
they are in one file (`<user cache dir>/genlab/weights/<entry>.weights`: a JSON header,
then each tensor's bytes at an offset aligned for the kernel's vector loads, which a
safetensors file does not promise) and mapped back with `torch.from_file` (private
pages read from the file on first touch: nothing is read or copied at load). `entry`
names the file (one per model, format and layout: a newer build replaces it); `key` is
everything the packed bytes depend on, written into the header and compared on load,
so a stale entry (its model file rewritten, another layout) is rebuilt.

A damaged file is detected without reading it all: the header records the file's size
(truncation) and a SHA-256 of the first and last 4 KiB of every tensor (a file
overwritten or zeroed in part). A full checksum would read every byte on every start,
about as long as packing itself; the file is only ever written whole (a temporary file,
then a rename), so a reader never sees a half-written one, and two processes building
at once each rename a whole file into place. A cache directory that cannot be written
leaves the weights packed in memory, with one line through `notify` saying so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUFFIX = ".weights"
MAGIC = b"genlab-weights-1"  # then the header's length (8 bytes, little-endian), the header
ALIGN = 64  # every tensor's offset: the kernel's vector loads of the weights are aligned
PAGE = 4096  # the data starts on a page: the file is mapped from offset 0
SAMPLE_BYTES = 4096  # hashed at each end of every tensor


def directory() -> Path:
    from genlib import cachedirs

    return cachedirs.weights()


def cached(entry: str, key: Mapping[str, Any], build: Callable[[], dict[str, torch.Tensor]],
           notify: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """The tensors `build()` returns for `key`: mapped from the cache when its entry is
    whole and was built for `key`, else built and written there (see the module doc)."""
    path = directory() / f"{entry}{SUFFIX}"
    found = _load(path, key)
    if found is not None:
        return found
    tensors = build()
    try:
        _write(path, key, tensors)
    except OSError as error:
        if notify is not None:
            notify(f"the weight cache {path.parent} cannot be written "
                   f"({error.strerror or error}); the weights stay packed in memory only, "
                   f"and are packed again on the next start")
    return tensors


def _encoded(key: Mapping[str, Any]) -> str:
    return json.dumps(dict(key), sort_keys=True)


def _header(path: Path) -> dict[str, Any] | None:
    """The entry's header, or None when it is missing or not one."""
    try:
        with open(path, "rb") as file:
            if file.read(len(MAGIC)) != MAGIC:
                return None
            length = int.from_bytes(file.read(8), "little")
            if length > 1 << 24:
                return None
            header = json.loads(file.read(length))
    except (OSError, ValueError):
        return None
    return header if isinstance(header, dict) else None


def _load(path: Path, key: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The entry's tensors mapped from the file, or None when it is missing, stale
    (another key) or damaged (another size than written, a sample that differs)."""
    import torch

    header = _header(path)
    if header is None or header.get("key") != _encoded(key):
        return None
    try:
        size = path.stat().st_size
        if size != header["size"]:
            return None
        whole = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        tensors = {name: whole[t["offset"]:t["offset"] + t["bytes"]]
                   .view(getattr(torch, t["dtype"])).view(t["shape"])
                   for name, t in header["tensors"].items()}
    except (OSError, RuntimeError, KeyError, TypeError, AttributeError):
        return None
    return tensors if header.get("sample") == _sample(tensors) else None


def _sample(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the first and last SAMPLE_BYTES of every tensor, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        data = tensors[name].contiguous().reshape(-1).view(torch.uint8)
        digest.update(name.encode())
        digest.update(data[:SAMPLE_BYTES].numpy().tobytes())
        digest.update(data[-SAMPLE_BYTES:].numpy().tobytes())
    return digest.hexdigest()


def _layout(tensors: Mapping[str, torch.Tensor], key: Mapping[str, Any]) -> bytes:
    """The header: where each tensor's bytes are, padded so the data starts on a page."""
    table, offset = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        table[name] = {"dtype": str(tensor.dtype).removeprefix("torch."),
                       "shape": list(tensor.shape), "offset": offset, "bytes": nbytes}
        offset += -(-nbytes // ALIGN) * ALIGN
    sample, start = _sample(tensors), 0
    while True:  # the offsets' digits lengthen the header that precedes them
        placed = {name: {**entry, "offset": entry["offset"] + start}
                  for name, entry in table.items()}
        text = json.dumps({"key": _encoded(key), "sample": sample, "size": start + offset,
                           "tensors": placed}).encode()
        needed = -(-(len(MAGIC) + 8 + len(text)) // PAGE) * PAGE
        if needed == start:
            return text + b" " * (start - len(MAGIC) - 8 - len(text))
        start = needed


def _write(path: Path, key: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """The entry, written whole under a temporary name and renamed into place."""
    import torch

    from genlib.cachedirs import written_whole

    header = _layout(tensors, key)
    with written_whole(path) as file:
        file.write(MAGIC + len(header).to_bytes(8, "little") + header)
        for tensor in tensors.values():
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            file.write(memoryview(data))
            file.write(b"\0" * (-len(data) % ALIGN))


@dataclass(frozen=True)
class Entry:
    """One cached file, as `genlab cache list` shows it."""

    path: Path
    size: int
    key: dict[str, Any]


def entries() -> list[Entry]:
    """Every entry in the cache directory (an unreadable one with an empty key)."""
    folder = directory()
    if not folder.is_dir():
        return []
    return [Entry(path, path.stat().st_size, _key_of(path))
            for path in sorted(folder.glob(f"*{SUFFIX}"))]


def _key_of(path: Path) -> dict[str, Any]:
    header = _header(path) or {}
    try:
        value = json.loads(header.get("key", "{}"))
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def stale(entry: Entry) -> bool:
    """Whether the model file an entry was packed from has changed or gone (by the
    path, size and mtime_ns its key records; an entry without them is never stale)."""
    file = entry.key.get("file")
    if not isinstance(file, str):
        return False
    try:
        stat = Path(file).stat()
    except OSError:
        return True
    return (stat.st_size, stat.st_mtime_ns) != (entry.key.get("size"), entry.key.get("mtime_ns"))


def leftovers() -> list[Path]:
    """Temporary files of writes that never finished (a process killed mid-write)."""
    folder = directory()
    return sorted(folder.glob(f".*{SUFFIX}.*.tmp")) if folder.is_dir() else []
