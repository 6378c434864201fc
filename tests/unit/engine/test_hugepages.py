"""The engine's weights and KV pool on transparent huge pages (lmops.runtime.hugepages)."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from lmops.runtime.engine import LLMEngine, SamplingParams
from lmops.runtime.engine.forward import FusedForward
from lmops.runtime.hugepages import HUGE_PAGE, huge_page_zeros, move_to_huge_pages
from lmops.runtime.model import Llama

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping(ptr: int) -> tuple[int, int, int]:
    """The start and end of the mapping that holds address `ptr`, and its AnonHugePages in
    KiB (/proc/self/smaps)."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            start, end = int(m[1], 16), int(m[2], 16)
            found = (start, end) if start <= ptr < end else None
        elif found and line.startswith("AnonHugePages:"):
            return (*found, int(line.split()[1]))
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_huge_page_zeros_starts_on_a_huge_page_and_is_zero():
    z = huge_page_zeros(3 * HUGE_PAGE // 4 + 5, torch.float32)
    assert z.data_ptr() % HUGE_PAGE == 0
    assert z.dtype == torch.float32 and z.shape == (3 * HUGE_PAGE // 4 + 5,)
    assert not z.any()
    z.fill_(1.5)
    assert z.sum() == 1.5 * z.numel()


@pytest.mark.skipif(
    not THP.is_file() or "[never]" in THP.read_text(), reason="this kernel has transparent huge pages off"
)
def test_the_kernel_backs_it_with_huge_pages():
    """The advice is taken: touched, the buffer is on 2 MiB pages (AnonHugePages in smaps).
    Memory from torch's allocator, where THP is in its default madvise mode, is not."""
    z = huge_page_zeros(4 * HUGE_PAGE // 4, torch.float32)
    z.fill_(1.0)
    assert mapping(z.data_ptr())[2] >= 2 * HUGE_PAGE // 1024
    if "[madvise]" in THP.read_text():
        plain = torch.empty(4 * HUGE_PAGE // 4).fill_(1.0)
        assert mapping(plain.data_ptr())[2] == 0


def test_moved_tensors_keep_their_identity_values_and_sharing():
    linear = torch.nn.Linear(8, 12)
    fused = torch.randn(20, 8)
    rest = fused[12:]
    linear.weight.data = fused[:12]
    before = fused.clone(), linear.bias.detach().clone()
    weight = linear.weight
    move_to_huge_pages([fused, linear.weight, rest, linear.bias, linear.weight])
    assert linear.weight is weight
    # One mapping, but each storage its own: a compiled graph's inputs must not alias.
    start, end, _ = mapping(fused.data_ptr())
    assert start <= linear.bias.data_ptr() < end
    assert fused.untyped_storage().data_ptr() != linear.bias.untyped_storage().data_ptr()
    assert torch.equal(fused, before[0]) and torch.equal(linear.bias, before[1])
    assert torch.equal(linear.weight, before[0][:12]) and torch.equal(rest, before[0][12:])
    fused[0, 0] = 42.0  # still views of one storage
    assert linear.weight[0, 0] == 42.0


def test_only_cpu_memory_moves():
    cpu = torch.zeros(4)
    where = cpu.data_ptr()
    with pytest.raises(ValueError, match="a meta tensor; only CPU memory moves"):
        move_to_huge_pages([cpu, torch.zeros(4, device="meta")])
    assert cpu.data_ptr() == where  # checked before anything moved


def test_the_engine_reads_its_weights_and_pool_from_huge_pages(model_dir):
    """Every tensor the fused forward reads, the model's parameters and the KV pool are in
    huge-page memory, and the model still computes what it did before the move."""
    model = Llama.from_pretrained(model_dir).eval()
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    with torch.no_grad():
        before = model(ids)
        forward = FusedForward(model)
        after = model(ids)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    start, end, _ = mapping(model.model.embed_tokens.weight.data_ptr())
    tensors = [*model.parameters(), *(w for layer in forward.layers for w in layer), forward.cos]
    assert all(start <= t.data_ptr() < end for t in tensors)

    engine = LLMEngine.from_pretrained(model_dir, device="cpu", compile=False, drift_sample=0)
    kv = engine.runner.pool.kv
    assert kv.data_ptr() % HUGE_PAGE == 0
    out = engine.generate([[5, 17, 99]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4


def test_a_kernel_without_huge_pages_gives_ordinary_memory(monkeypatch):
    """madvise fails with EINVAL on a kernel built without THP (here: an advice no kernel
    knows, so the real call fails): the memory is still there, on ordinary pages."""
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)
    with pytest.raises(OSError):
        mmap.mmap(-1, 4096).madvise(mmap.MADV_HUGEPAGE)
    z = huge_page_zeros(1000, torch.float32)
    z.fill_(2.0)
    assert z.sum() == 2000.0
