"""glibc malloc kept from handing large freed buffers back to the kernel, in the processes
that move answers (the front and the replica workers).

Why: glibc serves an allocation above its mmap threshold with a fresh mapping and unmaps it on
free, and shrinks its heap once the free space on top passes the trim threshold. An answer's
buffers are that size (a hidden-states chunk is 2 MiB, a top-64 answer of 500 tokens 256 KiB),
and several are alive at once, so glibc's dynamic threshold does not settle: every answer's
bytes then land on pages the kernel must fault in and zero again. Measured with
`bench/front_cpu.py`'s hidden-states run, that was a third of the front's CPU. With the threshold
at 32 MiB (glibc's most) and trimming above 256 MiB, freed answers are reused in place; the
process keeps up to that much free memory, a small price on a teacher node.

Nothing happens where the C library is not glibc (musl, macOS): the call reports False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD_BYTES = 256 << 20


def keep_large_buffers() -> bool:
    """Set the thresholds for this process; True where glibc took both."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    taken = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not taken:
        log.info("malloc thresholds not set (not glibc?): large answers may cost page faults")
    return taken
