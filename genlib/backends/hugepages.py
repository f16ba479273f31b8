"""Tensors backed by 2 MiB pages, for weights a decode step streams from memory.

A one-row decode step reads every weight once, front to back. With 4 KiB pages that is a
new page (a TLB miss, and a stop for the hardware prefetcher, which does not cross page
boundaries) every 4 KiB; with 2 MiB pages, one every 2 MiB, so a step streaming the
fused q/k/v and gate/up weights from them waits less on address translation.

Linux gives an anonymous mapping 2 MiB pages ("transparent huge pages") when the mapping
is 2 MiB-aligned and `madvise(MADV_HUGEPAGE)` asks for them before the pages are first
written, which is all `empty` does, on a mapping of its own: memory from the allocator
can be pages already written (glibc serves large blocks from its heap once its mmap
threshold has risen), which stay 4 KiB pages. Elsewhere (another OS, a kernel with them switched
off, a device other than the CPU) it returns an ordinary tensor: the values are the same
either way.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-d tensor of `numel` elements, starting on a 2 MiB boundary and
    advised into 2 MiB pages where the platform allows (see the module doc)."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return torch.empty(numel, dtype=dtype, device=device)
    length = numel * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, length + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(view)
    del view  # the mapping stays open: the tensor holds it
    offset = -address % PAGE
    _advise(address + offset, length)
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)


def _advise(address: int, length: int) -> bool:
    """Ask for 2 MiB pages over [address, address + length); whether the kernel agreed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length),
                            MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):  # no libc to ask: ordinary pages
        return False
