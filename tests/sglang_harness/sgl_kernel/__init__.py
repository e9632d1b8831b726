"""Stand-in for the `sgl_kernel` package, so the real sglang 0.5.23 server runs on a CPU without AMX (tests only).

What it replaces and why: sglang imports its compiled kernels from `sgl_kernel`. The PyPI `sgl-kernel` wheel is a
CUDA build (importing it fails with "libcuda.so.1: cannot open shared object file"), and the CPU build is
source-only, AMX/AVX-512-oriented and not installable here. With `SGLANG_USE_CPU_ENGINE=1`, sglang imports a set
of `*_cpu` symbols at module import time (`if _is_cpu: from sgl_kernel import ...`), but on a CPU without AMX it
runs torch-native code for everything the tiny Qwen3-MoE test model needs, except one function:
`assign_req_to_token_pool_cpu`, called by `sglang/srt/mem_cache/allocation.py` to write newly allocated KV-cache
slots into the request-to-token table. That one is implemented here in plain torch. Every other name resolves
(module `__getattr__`) to a stub that raises NotImplementedError if it is ever called, so a code path that would
need a real kernel fails loudly instead of silently computing something else.

This directory must come first on the server's PYTHONPATH (tests/helpers/sglang_server.py does that).
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn

import torch

__all__ = ["assign_req_to_token_pool_cpu"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int | None = None,
    *unused: Any,
) -> None:
    """In place: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[o_i:o_i + n_i]`,
    with `n_i = end_offset[i] - start_offset[i]` and `o_i = n_0 + ... + n_{i-1}` (the slots of all requests of the
    batch are concatenated in `out_cache_loc`, in batch order). `pool_len` is the row length of `req_to_token`
    (checked); any further arguments (the CUDA/Triton variants pass a power-of-two batch bound) are ignored.
    """
    if pool_len is not None and req_to_token.shape[1] != int(pool_len):
        raise ValueError(f"req_to_token has rows of {req_to_token.shape[1]}, pool_len={pool_len}")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    total = sum(e - s for s, e in zip(starts, ends))
    if total > out_cache_loc.numel():
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots, the batch needs {total}")
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _stub(name: str) -> Callable[..., NoReturn]:
    def stub(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is the CPU test stand-in (tests/sglang_harness/sgl_kernel), "
            "which implements only assign_req_to_token_pool_cpu"
        )

    stub.__name__ = stub.__qualname__ = name
    return stub


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(name)
