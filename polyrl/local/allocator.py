"""How the local engine asks glibc's allocator for memory.

Resident memory stays down by serving every large block (256 KiB and up) with pages mapped for it alone
and unmapped when it is freed; a training pass or a sampling batch, which frees and allocates the same
sizes over and over, takes its blocks below 4 MiB from the heap instead and trims it when it ends.
Elsewhere than glibc (musl, macOS), nothing is tuned."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from typing import Iterator

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK_BYTES = 256 << 10  # blocks from this size up are mmap'd, and go back to the OS when freed ...
PASS_HEAP_BLOCK_BYTES = 4 << 20  # ... except, during a pass that reuses its memory, blocks below this


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """glibc, where it is the C library with ``mallopt`` and ``malloc_trim`` (not musl, not macOS)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both exist
        return libc
    except (OSError, AttributeError):
        return None


def return_large_blocks_to_the_os() -> None:
    """Serve large allocations (256 KiB and up) by mmap, always.

    glibc raises its mmap threshold every time a large block is freed, up to 32 MiB, after which
    activation-sized tensors come from the heap, whose freed space fragments and stays resident:
    a checkpointed backward, which frees and re-allocates one block's activations per layer, then
    grew resident memory by ~60 KB per token per layer (2.3 GB on a 2,048-token 8-layer pass, against
    0.4 GB with the threshold fixed). Fixing the threshold keeps freed tensors out of the process."""
    if (libc := glibc()) is not None:
        libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(LARGE_BLOCK_BYTES))


_pass_lock = threading.Lock()
_passes = 0  # passes inside heap_for_the_pass, on any engine's thread


@contextlib.contextmanager
def heap_for_the_pass(enabled: bool = True) -> Iterator[None]:
    """For one training pass or sampling batch, serve blocks below ``PASS_HEAP_BLOCK_BYTES`` from the heap,
    and give its free pages back to the OS (``malloc_trim``) when the pass ends.

    Under the fixed threshold, every tensor from 256 KiB up is fresh pages that the kernel maps and zeroes
    one by one: a SmolLM2-135M forward_backward of 1,440 packed tokens took 2.6M page faults and ~5 s of
    system time in 10 s. Within the pass the heap reuses freed blocks instead (10.3 -> 7.9 s), at the cost
    of a higher peak (3.5 -> 4.5 GB there: freed blocks stay in the heap until the pass ends); the trim
    returns resident memory to where it was (1.4 GB). Blocks of 4 MiB and up (the activations of large
    passes) are still mmap'd, which bounds what the heap holds: 8 x 1,024 tokens peak at 8.1 GB against
    7.4, in the same time. Not for a checkpointed model's training pass (``enabled`` False: checkpointing
    is the setting that trades time for memory, and its backward fragments the heap, see
    :func:`return_large_blocks_to_the_os`)."""
    global _passes
    libc = glibc()
    if not enabled or libc is None:
        yield
        return
    with _pass_lock:
        _passes += 1
        libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(PASS_HEAP_BLOCK_BYTES))
    try:
        yield
    finally:
        with _pass_lock:
            _passes -= 1
            if _passes == 0:
                libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(LARGE_BLOCK_BYTES))
        libc.malloc_trim(0)


def give_back_free_memory() -> None:
    """Return the free pages of every malloc arena to the OS (``malloc_trim``), e.g. once a released
    client's adapter and optimizer state are freed. glibc keeps freed small blocks in each thread's
    arena and only trims the top of the main heap by itself, so a server whose sessions come and go
    would otherwise stay at the high-water mark of all of them."""
    if (libc := glibc()) is not None:
        libc.malloc_trim(0)
