"""Large I/O buffers that start on a page.

Why not a ``bytearray``: one of a few MiB is malloc's own mapping, its bytes 16 past a page
start, and on this machine's CPU (AMD EPYC, the CI and benchmark machines) a copy whose
destination lies 1-40 bytes past its source modulo 4 KiB runs about 5x slower (4K aliasing: the
loads of the source wait on the stores just made to the destination). The kernel's copies into
such a buffer pay it: ``preadv`` of a 64 MiB file from the page cache into a 4 MiB
``bytearray`` (+16) ran at 1.3-1.6 GB/s, into an anonymous mapping (+0) at 9.2-11.3 GB/s, +64
at 8.8-10.2 (2026-12-07, a scratch script). The FUSE ring's payloads (initiator/fuse/_loop.pyx)
met the same. An anonymous mapping is also not zero-filled up front: its pages come at first
touch, as the copy fills them.
"""

from __future__ import annotations

import mmap


def page_aligned(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes that starts on a page (an anonymous private
    mapping, freed with the last view of it)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]
