"""``hostmem.fresh_bytes``: the buffers restores and peer transfers receive into are ordinary
pages, never advised for transparent huge pages (whose first touch can make the kernel
compact memory: the slow first restore of a process)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ckptpilot.hostmem import fresh_bytes

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/smaps is Linux's")

SIZE = 64 << 20  # well above numpy's threshold for asking for huge pages


def _vm_flags(array: np.ndarray) -> list[str]:
    """The ``VmFlags`` of the mapping that holds ``array``'s middle byte (the advice splits
    a mapping: its first page, with the allocator's header, is not advised)."""
    address = array.ctypes.data + array.size // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_a_fresh_buffer_is_writable_and_not_advised_for_huge_pages() -> None:
    buf = fresh_bytes(SIZE)
    buf[::4096] = 7
    assert buf.size == SIZE and buf.dtype == np.uint8 and buf.flags.writeable
    assert int(buf[::4096].sum()) == 7 * (SIZE // 4096)
    assert "hg" not in _vm_flags(buf)


def test_numpy_would_have_asked_for_huge_pages() -> None:
    """The control: without it the test above would pass on a kernel that never marks any
    mapping, and prove nothing."""
    flags = _vm_flags(np.empty(SIZE, dtype=np.uint8))
    if "hg" not in flags:
        pytest.skip("this numpy or kernel does not advise huge pages: nothing to avoid")
    assert "hg" in flags


def test_an_empty_buffer_is_an_empty_array() -> None:
    assert fresh_bytes(0).size == 0
