"""genlib.backends.hugepages: weight buffers on 2 MiB boundaries, in 2 MiB pages where
Linux has transparent huge pages on."""

import re
import sys
from pathlib import Path

import pytest
import torch

from genlib.backends import hugepages
from genlib.backends.llama import LeanLlama

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and (
        "[always]" in THP.read_text() or "[madvise]" in THP.read_text())


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def kernel_gives_huge_pages() -> bool:
    """Whether a fresh mapping, advised and written without genlib, gets a huge page
    now: the kernel backs one only while it has a free 2 MiB page, which a long run can
    leave it without."""
    import ctypes
    import mmap

    # private and anonymous, as malloc's are (a shared mapping is shmem, another policy);
    # 6 MiB holds a whole aligned 2 MiB page wherever it lands
    probe = mmap.mmap(-1, 6 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe.madvise(mmap.MADV_HUGEPAGE)
    probe.write(b"\1" * len(probe))
    address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    return huge_kib_at(address) >= 2048


def test_empty_is_aligned_and_writable():
    t = hugepages.empty(3 << 20, torch.float32, torch.device("cpu"))
    assert t.numel() == 3 << 20 and t.dtype == torch.float32
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % hugepages.PAGE == 0
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * (3 << 20)


@pytest.mark.skipif(not thp_available(), reason="no transparent huge pages here")
def test_lean_fused_weights_sit_in_huge_pages(code_target):
    lean = LeanLlama.from_model(code_target.model)
    qkv = lean.layers[0].qkv.w
    assert qkv.data_ptr() % hugepages.PAGE == 0  # the buffer's first matrix
    if huge_kib_at(qkv.data_ptr()) < 2048 and not kernel_gives_huge_pages():
        pytest.skip("the kernel gives no huge page to any buffer now (memory fragmented)")
    assert huge_kib_at(qkv.data_ptr()) >= 2048
    # Every layer's fused matrices share the one buffer.
    storages = {p.w.untyped_storage().data_ptr() for layer in lean.layers
                for p in (layer.qkv, layer.gate_up)}
    assert len(storages) == 1
