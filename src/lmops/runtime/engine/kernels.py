"""lmops' own C++ kernels for the compiled CPU decode graph (kernels.cpp): the few-row
float32 products (`torch.ops.lmops.small_linear`, through `forward.linear`, against weights
packed by `pack_weight`) and the decode attention (`torch.ops.lmops.decode_attention`,
compiled.DecodeAttention). Built with the C++ compiler inductor uses, the first time an
engine compiles its decode graphs on a machine (about 10 s on 2 cores), and kept beside the
graphs, which load them in milliseconds after that.

At batch 1 a decode step is its products, each reading a weight once, and inductor's loop
for a product of a few rows streams the weight once a row, where the kernel streams it once
for every 6 rows, in blocks laid out in the order it reads them; the attention was two
batched products through MKL (its generic code on AMD CPUs) around a softmax, and is one
call a layer. Built where the CPU has AVX2 and FMA (torch's CPU capability AVX2 or AVX512);
elsewhere, or if the build fails (logged), the graphs keep inductor's loops and MKL's
attention. What they gain: benchmarks/README.md, "Kernels of our own" and "The products'
weights packed for the kernel".
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
BLOCK = 16  # a packed weight's rows a block (kernels.cpp's kBlock)
_loaded: bool | None = None  # None: not tried in this process
_loading = threading.Lock()  # engines may start in threads (a live champion's swap)


def load_kernels(directory: Path, cpu_signature: str) -> bool:
    """Build the kernels (`build_kernels`) and load them, once a process (a library
    registers its ops for good); whether they are loaded."""
    global _loaded
    with _loading:
        if _loaded is None:
            library = build_kernels(directory, cpu_signature)
            if library is not None:
                torch.ops.load_library(str(library))
                torch.library.register_fake("lmops::small_linear")(_small_linear_shape)
                torch.library.register_fake("lmops::decode_attention")(_decode_attention_shape)
            _loaded = library is not None
        return _loaded


def kernels_loaded() -> bool:
    """Whether lmops' ops are there for a graph to call."""
    return bool(_loaded)


def build_kernels(directory: Path, cpu_signature: str) -> Path | None:
    """The kernels' shared library in `directory`, built there unless it already is, once
    per source, torch, compiler and CPU (`cpu_signature`: it is compiled for this CPU, and
    a cache directory may be shared by machines); None where the CPU lacks AVX2 and FMA or
    the build fails (logged: the graphs keep inductor's loops and MKL's attention)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = get_cpp_compiler()
    flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
    flags += ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]  # at::vec's 8-float vectors
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__} {compiler} {flags} {cpu_signature}".encode())
    library = directory / f"kernels-{key.hexdigest()[:32]}.so"
    if library.is_file():
        return library
    built = library.with_name(f".{library.name}.{os.getpid()}.tmp")  # renamed when whole
    command = [compiler, *flags, *(f"-isystem{p}" for p in include_paths()), str(SOURCE), "-o", str(built)]
    command += [*(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(built, library)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()
        errors = [line for line in detail.splitlines() if "error" in line]  # the compiler's first
        log.warning(
            "lmops' kernels not built, the graphs keep inductor's loops and MKL's attention: %s",
            (errors or [detail])[0],
        )
        built.unlink(missing_ok=True)
        return None
    return library


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight (N, K) as `small_linear` reads it: (ceil(N / 16), K, 16), blocks of
    16 of its rows (the last one padded with zeros), each stored k-major, so the kernel
    streams a block front to back whatever the number of rows."""
    blocks = -(-w.shape[0] // BLOCK)
    padded = torch.nn.functional.pad(w.detach(), (0, 0, 0, blocks * BLOCK - w.shape[0]))
    return padded.view(blocks, BLOCK, w.shape[1]).transpose(1, 2).contiguous()


def _small_linear_shape(x: torch.Tensor, w_blocks: torch.Tensor, n: int) -> torch.Tensor:
    """What small_linear returns, for tracing: (rows, n), contiguous."""
    return x.new_empty(x.shape[0], n)


def _decode_attention_shape(q, k, v, mask, scale) -> torch.Tensor:
    """What decode_attention returns, for tracing: q's shape, contiguous."""
    return q.new_empty(q.shape)
