"""The toy estimator's pinned CPU arithmetic: the same weights, and so the same demo table, on any x86-64 CPU.

Training the estimator for 192 steps carries the last bits in which torch's CPU kernels differ
between machines into different weights, and the demo's table with them (docs/lab.md, "Across
machines": beta 0.4060 to 0.5199 on one machine under other machines' settings). What differs
between x86-64 machines: the instruction set of ATen's kernels (AVX-512 where the CPU has it, else
AVX2), of oneDNN's, MKL's code path for the CPU, and the number of threads. The estimator is trained
(and the demo scores) with all four fixed to what every x86-64 CPU of the last decade has: AVX2 and
2 threads. ATen, oneDNN and MKL read their settings when torch starts, so `pin_cpu_numerics` runs
before torch is imported (the `demo` and `synth train-estimator` commands call it first); the thread
count is the recipe's (`EstimatorRecipe.threads`), set while it runs. Measured cost on the 2-core
machine: none beyond noise (`demo --retrain`: 201 CPU s with these settings, 196 s without).
"""

from __future__ import annotations

import contextlib
import os
import sys

from pairclean.ops.records import JsonObject

# ATen's dispatch, oneDNN's and MKL's (conditional numerical reproducibility) instruction sets.
CPU_NUMERICS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}


def pin_cpu_numerics() -> bool:
    """Fix the instruction sets for this process; False when torch is imported already (too late:
    this process keeps the machine's own)."""
    if "torch" in sys.modules:
        return False
    os.environ.update(CPU_NUMERICS)
    return True


def numerics_pinned() -> bool:
    """Whether this process runs with the pinned arithmetic (False: torch started before the pin,
    or the CPU has no AVX2)."""
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX2" and \
        all(os.environ.get(name) == value for name, value in CPU_NUMERICS.items())


def cpu_numerics() -> JsonObject:
    """What decides this process's CPU arithmetic: recorded beside a trained estimator, and part of its cache key."""
    import torch

    return {"capability": torch.backends.cpu.get_cpu_capability(),
            **{name: os.environ.get(name) for name in ("ONEDNN_MAX_CPU_ISA", "MKL_CBWR")}}


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's intra-op threads for the duration (reductions and MKL's blocking depend on their number)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
