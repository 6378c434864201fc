"""lmops' own C++ kernel for the compiled decode graph's few-row float32 products
(small_linear.cpp, `torch.ops.lmops.small_linear`), built with the C++ compiler inductor
uses, the first time an engine compiles its decode graphs on a machine, and loaded from
beside the graphs after that (a second, about 10 s on 2 cores, then milliseconds).

At batch 1 a decode step is mostly its products, each reading a weight once, and
inductor's loop for a product of a few rows streams the weight once a row; the kernel
streams it once a step and reuses it from L1 for every row, so one row runs about 1.5x
faster (the LM head 57-61 us against 119 on an AVX2 EPYC) and a 5-row verification of
speculative decoding costs far less than five (benchmarks/README.md, "A kernel of our own
for the few-row products"). Built where the CPU has AVX2 and FMA (torch's CPU capability
AVX2 or AVX512); elsewhere, or if the build fails (logged), the graph keeps inductor's loop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_linear.cpp")
_loaded: bool | None = None  # None: not tried in this process


def load_small_linear(directory: Path, cpu_signature: str) -> bool:
    """Build the kernel (`build_small_linear`) and load it, once a process (a library
    registers its op for good); whether it is loaded."""
    global _loaded
    if _loaded is None:
        library = build_small_linear(directory, cpu_signature)
        if library is not None:
            torch.ops.load_library(str(library))
            torch.library.register_fake("lmops::small_linear")(_small_linear_shape)
        _loaded = library is not None
    return _loaded


def small_linear_loaded() -> bool:
    """Whether `torch.ops.lmops.small_linear` is there for a graph to call."""
    return bool(_loaded)


def build_small_linear(directory: Path, cpu_signature: str) -> Path | None:
    """The kernel's shared library in `directory`, built there unless it already is, once
    per source, torch, compiler and CPU (`cpu_signature`: it is compiled for this CPU, and
    a cache directory may be shared by machines); None where the CPU lacks AVX2 and FMA or
    the build fails (logged: the graphs keep inductor's loop)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = get_cpp_compiler()
    flags = ["-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
    flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__} {compiler} {flags} {cpu_signature}".encode())
    library = directory / f"small_linear-{key.hexdigest()[:32]}.so"
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
            "small_linear kernel not built, the graphs keep inductor's loop: %s", (errors or [detail])[0]
        )
        built.unlink(missing_ok=True)
        return None
    return library


def _small_linear_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel returns, for tracing: (rows, N), contiguous."""
    return x.new_empty(x.shape[0], w.shape[0])
