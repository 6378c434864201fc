"""CPU tensors on 2 MiB pages (Linux's transparent huge pages).

A decode step streams every weight once a token: 9.4 MB for the default model, read from
the L3 cache or memory, about 2,300 pages of 4 KiB, more than the second-level TLB holds. On
2 MiB pages the model's 17 products ran 1.05x as fast at 1 thread and 1.04x at 2
(benchmarks/hugepages.py), and a whole single stream 0.985x-1.05x in five A/B runs, about
1.02x on average (a 2-core Xeon: benchmarks/README.md, "Huge pages"). Linux's default THP
mode, `madvise`, gives huge pages only to memory that asks for them, and torch's allocator
does not ask (unless THP_MEM_ALLOC_ENABLE=1, and then only for allocations of 2 MiB and
more), so the engine's weights and KV pool live in anonymous memory advised MADV_HUGEPAGE.
Where the OS has no such advice, or THP is off, that memory is on ordinary pages and nothing
else changes.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE = 2 << 20
# Each storage moved by `move_to_huge_pages` starts on a cache line, as the allocator's do.
_ALIGN = 64


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D zero-filled CPU tensor of `numel` elements that starts on a 2 MiB boundary, in
    anonymous memory advised MADV_HUGEPAGE. Its pages are faulted in as first touched."""
    memory, start = _huge_page_memory(numel * dtype.itemsize)
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=start)  # keeps `memory` alive


def move_to_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Move the storages of the CPU `tensors` into one huge-page mapping, in place
    (`Tensor.set_`): each tensor object keeps its identity (a module's parameter stays that
    parameter), and tensors that shared a storage (fused weights and their views, tied
    embeddings) share the moved one. Each storage stays a storage of its own, at its own
    place in the mapping (a compiled graph must not see its inputs alias one another)."""
    tensors = list({id(t): t for t in tensors}.values())
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"move_to_huge_pages: a {t.device.type} tensor; only CPU memory moves")
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    places, total = {}, 0
    for ptr, storage in storages.items():
        places[ptr] = total
        total += -(-max(storage.nbytes(), 1) // _ALIGN) * _ALIGN
    memory, start = _huge_page_memory(total)
    moved = {}
    for ptr, storage in storages.items():
        new = torch.frombuffer(
            memory, dtype=torch.uint8, count=max(storage.nbytes(), 1), offset=start + places[ptr]
        )
        new[: storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        moved[ptr] = new.untyped_storage()
    with torch.no_grad():
        for t in tensors:
            t.set_(moved[t.untyped_storage().data_ptr()], t.storage_offset(), t.shape, t.stride())


def _huge_page_memory(nbytes: int) -> tuple[mmap.mmap, int]:
    """Private anonymous memory advised MADV_HUGEPAGE with room for `nbytes` from its first
    2 MiB boundary on, and that boundary's offset. (Private: shared anonymous memory is
    shmem, which THP backs only where its own setting, shmem_enabled, says so.)"""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # not Linux; a kernel without THP: EINVAL
        memory.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr()
    return memory, -address % HUGE_PAGE
