"""The doorbell's GPU word: its packing, and what the driver binding does where there is no GPU."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto.gpu_word import DevicePointer, GpuWordError, GpuWordOps, RegisteredPage


def test_word_packs_sequence_high_and_key_low():
    w = bell.gpu_word(0x1234, 0xABCD)
    assert w >> 32 == 0x1234 and w & 0xFFFFFFFF == 0xABCD
    # The sidecar's wait is "word >= seq << 32": any key of that sequence passes it, the next
    # sequence's wait does not, and a sequence past 2^32 wraps as the driver's compare does.
    assert bell.gpu_word(7, bell.SKIP_KEY) >= bell.gpu_word(7, 0) > bell.gpu_word(6, bell.SKIP_KEY)
    assert bell.gpu_word(1 << 32, 3) == bell.gpu_word(0, 3)


def test_page_word_is_the_sixth_header_word():
    buf = np.zeros(bell.HEADER + 2 * 64, np.uint8)
    page = bell.Page(buf, 64)
    page.words[bell.GPU_WORD] = bell.gpu_word(5, 9)
    assert buf[bell.GPU_WORD_OFFSET : bell.GPU_WORD_OFFSET + 8].view(np.uint64)[0] == bell.gpu_word(5, 9)
    assert bell.GPU_WORD_OFFSET + 8 <= bell.HEADER


def test_no_ops_without_a_gpu():
    """On a CPU device (or a host without a driver) steps are simply not pre-launched."""
    assert GpuWordOps.load(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert GpuWordOps.load(torch.device("cuda", 0)) is None


class _Ops:
    def __init__(self):
        self.calls = []

    def register(self, ptr, nbytes):
        self.calls.append(("register", ptr, nbytes))
        return ptr + 0x1000

    def unregister(self, ptr):
        self.calls.append(("unregister", ptr))


def test_registered_page_is_page_aligned_and_closed_once():
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    ops = _Ops()
    with pytest.raises(GpuWordError, match="page-aligned"):
        RegisteredPage(ops, base + 8)
    page = RegisteredPage(ops, base)
    assert page.device_ptr == base + 0x1000
    page.close()
    page.close()
    assert ops.calls == [("register", base, mmap.PAGESIZE), ("unregister", base)]


def test_device_pointer_is_what_triton_reads():
    p = DevicePointer(0xDEAD000, torch.int64)
    assert p.data_ptr() == 0xDEAD000 and p.dtype == torch.int64
