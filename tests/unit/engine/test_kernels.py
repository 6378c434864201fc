"""lmops' kernels (engine/kernels.py, kernels.cpp): each equal to what it replaces on every
shape a decode graph can hand it, built once per machine, and a failed build logs the
compiler's message, leaves nothing on disk and keeps inductor's loops."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch
import torch.nn.functional as F

from lmops.runtime.engine import kernels
from lmops.runtime.engine.compiled import DecodeAttention

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the kernels need AVX2 and FMA"
)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The kernels, built for "cpu A" into a directory of this module's."""
    built = kernels.build_kernels(tmp_path_factory.mktemp("kernels"), "cpu A")
    assert built is not None and built.is_file()
    return built


@pytest.fixture(scope="module")
def ops(library):
    """torch.ops.lmops: this module's build, unless an engine loaded one already."""
    assert kernels.load_kernels(library.parent, "cpu A")
    return torch.ops.lmops


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 15])
@pytest.mark.parametrize(
    ("n", "k"), [(320, 192), (4096, 192), (192, 1024), (100, 13), (7, 1), (64, 8), (65, 9)]
)
def test_small_linear_equals_f_linear(ops, rows, n, k):
    """Every register tile (1 to 6 rows of x) and rows past 6, whole blocks of 16 of w's rows
    and a padded last one (n not a multiple of 16), any K (and K not a multiple of the tiles'
    split of the k loop)."""
    x, w = torch.randn(rows, k), torch.randn(n, k)
    blocks = kernels.pack_weight(w)
    assert blocks.shape == (-(-n // 16), k, 16)
    torch.testing.assert_close(ops.small_linear(x, blocks, n), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_small_linear_takes_strided_inputs_and_refuses_others(ops):
    x, w = torch.randn(3, 40)[:, ::2], torch.randn(130, 64)[:, 10:30]
    packed = kernels.pack_weight(w)
    strided = packed.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    for blocks in (packed, strided):
        torch.testing.assert_close(ops.small_linear(x, blocks, 130), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert ops.small_linear(x[:0], packed, 130).shape == (0, 130)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        ops.small_linear(x.double(), packed.double(), 130)
    for n in (128, 145, -1):  # fewer or more rows than the 9 blocks hold
        with pytest.raises(RuntimeError, match=r"w_blocks \(ceil\(n / 16\), K, 16\), n >= 0"):
            ops.small_linear(x, packed, n)
    with pytest.raises(RuntimeError, match=r"w_blocks \(ceil\(n / 16\), K, 16\)"):
        ops.small_linear(x, kernels.pack_weight(torch.randn(4, 7)), 4)


def attention(q, k, v, mask, scale):
    """What decode_attention computes, in torch: batch t's mask is mask[t % B]."""
    mask = mask.repeat(q.shape[0] // mask.shape[0], 1, 1)
    return ((q @ k.transpose(1, 2)) * scale + mask).softmax(-1) @ v


@pytest.mark.parametrize(
    ("heads", "B", "R", "N", "D"), [(2, 1, 3, 200, 32), (2, 2, 15, 37, 32), (1, 1, 1, 1, 8), (3, 2, 4, 9, 64)]
)
def test_decode_attention_equals_softmax_of_the_products(ops, heads, B, R, N, D):
    """Keys in blocks of 4 and past them, rows in pairs and alone, D over several vectors,
    each sequence's own mask (the hidden keys -inf)."""
    q, k, v = torch.randn(heads * B, R, D), torch.randn(heads * B, N, D), torch.randn(heads * B, N, D)
    mask = torch.zeros(B, R, N)
    for b in range(B):
        mask[b, :, 1 + (N - 1) * b // B :] = float("-inf")  # sequence b sees fewer keys
    got = ops.decode_attention(q, k, v, mask, D**-0.5)
    torch.testing.assert_close(got, attention(q, k, v, mask, D**-0.5), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="B dividing BH, D % 8 == 0"):
        ops.decode_attention(q[..., :6], k[..., :6], v[..., :6], mask, 1.0)


@pytest.mark.parametrize("tokens", [1, 5])
def test_decode_attention_is_the_graphs_attention(ops, tokens, monkeypatch):
    """compiled.DecodeAttention through the kernel equals it through the batched products:
    two sequences that see different numbers of cached keys, a plain step and a 5-row
    verification (causal among its new tokens)."""
    Hkv, G, B, keys, D = 2, 3, 2, 37, 32
    context = torch.randn(1, 2 * Hkv, B, keys, D)
    cached = torch.tensor([20] * tokens + [keys] * tokens)
    q, kv = torch.randn(B * tokens, Hkv * G, D), torch.randn(B * tokens, 2 * Hkv, D)
    out = {}
    for loaded in (True, False):
        monkeypatch.setattr(kernels, "_loaded", loaded)
        out[loaded] = DecodeAttention(context, cached, G)(0, q, kv)
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)


def test_kernels_are_built_once_per_cpu(library, monkeypatch):
    built = library.stat().st_mtime_ns

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert kernels.build_kernels(library.parent, "cpu A") == library
    assert library.stat().st_mtime_ns == built
    monkeypatch.undo()
    # Another CPU (a cache directory shared by machines) gets a library of its own.
    other = kernels.build_kernels(library.parent, "cpu B")
    assert other is not None and other != library
    assert sorted(p.name for p in library.parent.iterdir()) == sorted([library.name, other.name])


def test_a_failed_build_logs_the_compiler_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.build_kernels(out, "cpu A") is None
    assert "lmops' kernels not built, the graphs keep inductor's loops and MKL's attention" in caplog.text
    assert "broken.cpp:1:1: error: expected unqualified-id" in caplog.text  # the compiler's own words
    assert list(out.iterdir()) == []
