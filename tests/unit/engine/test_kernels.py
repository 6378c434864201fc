"""lmops' few-row product kernel (engine/kernels.py, small_linear.cpp): equal to F.linear on
every shape a decode graph can hand it, built once per machine, and a failed build logs the
compiler's message, leaves nothing on disk and keeps inductor's loop."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch
import torch.nn.functional as F

from lmops.runtime.engine import kernels

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the kernel needs AVX2 and FMA"
)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    """The kernel, built for "cpu A" into a directory of this module's."""
    built = kernels.build_small_linear(tmp_path_factory.mktemp("kernels"), "cpu A")
    assert built is not None and built.is_file()
    return built


@pytest.fixture(scope="module")
def small_linear(library):
    """The op: this module's build, unless an engine loaded one already."""
    assert kernels.load_small_linear(library.parent, "cpu A")
    return torch.ops.lmops.small_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 15])
@pytest.mark.parametrize(("n", "k"), [(320, 192), (4096, 192), (192, 1024), (7, 13), (1, 1), (5, 8), (6, 9)])
def test_small_linear_equals_f_linear(small_linear, rows, n, k):
    """Whole and partial vectors of K, blocks of 4 rows of w and the rows past them, odd
    and even rows of x."""
    x, w = torch.randn(rows, k), torch.randn(n, k)
    torch.testing.assert_close(small_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_small_linear_takes_strided_inputs_and_refuses_others(small_linear):
    x, w = torch.randn(3, 40)[:, ::2], torch.randn(20, 64)[:, 10:30]
    torch.testing.assert_close(small_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        small_linear(x.double(), w.double())
    with pytest.raises(RuntimeError, match=r"x \(rows, K\) and w \(N, K\)"):
        small_linear(x, torch.randn(4, 7))


def test_small_linear_is_built_once_per_cpu(library, monkeypatch):
    built = library.stat().st_mtime_ns

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert kernels.build_small_linear(library.parent, "cpu A") == library
    assert library.stat().st_mtime_ns == built
    monkeypatch.undo()
    # Another CPU (a cache directory shared by machines) gets a library of its own.
    other = kernels.build_small_linear(library.parent, "cpu B")
    assert other is not None and other != library
    assert sorted(p.name for p in library.parent.iterdir()) == sorted([library.name, other.name])


def test_a_failed_build_logs_the_compiler_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.build_small_linear(out, "cpu A") is None
    assert "small_linear kernel not built, the graphs keep inductor's loop" in caplog.text
    assert "broken.cpp:1:1: error: expected unqualified-id" in caplog.text  # the compiler's own words
    assert list(out.iterdir()) == []
