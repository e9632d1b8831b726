"""Import hook for running the real sglang server on a CPU-only machine (test harness only).

What it replaces and why: sglang 0.5.23 allocates the routed-experts capture buffer (`--enable-return-routed-experts`)
with `sglang.srt.mem_cache.pool_host.common._cuda_host_register`, which calls `torch.cuda.cudart()` to pin host
memory and dies with "Found no NVIDIA driver" when there is no GPU. Pinning is only a transfer optimisation, so on a
machine without CUDA we skip it: the wrapped function returns early when `torch.cuda.is_available()` is False and
otherwise calls the original.

Why an import hook in `sitecustomize.py`: sglang starts its scheduler and detokenizer as fresh (spawned)
interpreters, so a patch applied only in the launching process would not reach them. Python imports
`sitecustomize` at start-up in every interpreter whose `sys.path` holds this directory (it is put on PYTHONPATH by
tests/helpers/sglang_server.py), so the hook is installed in each sglang process. site-packages is never edited.

Second guard, for `--tp 2` and more on CPU: sglang 0.5.23's `init_model_parallel_group`
(`sglang.srt.distributed.parallel_state`) turns PyNccl on for every group unless the platform is out-of-tree, and
`PyNcclCommunicator` dies with "Expected a cuda device, but got: cpu". Without CUDA the wrapper passes
use_pynccl=False (and no custom all-reduce, MSCCL++ or symmetric-memory all-reduce, which are CUDA-only too), so the
groups use torch.distributed on their gloo CPU group. Measured: a `--tp 2` server (with
SGLANG_CPU_OMP_THREADS_BIND="0|1", one core per rank) then starts and generates.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common"
_PARALLEL_STATE = "sglang.srt.distributed.parallel_state"


def _patch_host_register(module) -> None:
    original = getattr(module, "_cuda_host_register", None)
    if original is None or getattr(original, "_mpo_cpu_guard", False):
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        import torch

        if not torch.cuda.is_available():
            return None  # no GPU: leave host memory unpinned
        return original(*args, **kwargs)

    guarded._mpo_cpu_guard = True  # type: ignore[attr-defined]
    module._cuda_host_register = guarded


def _patch_parallel_state(module) -> None:
    original = getattr(module, "init_model_parallel_group", None)
    if original is None or getattr(original, "_mpo_cpu_guard", False):
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        import torch

        if not torch.cuda.is_available():  # no GPU: CUDA communicators off, torch.distributed (gloo) does it
            kwargs.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                          use_torch_symm_mem_allreduce=False)
        return original(*args, **kwargs)

    guarded._mpo_cpu_guard = True  # type: ignore[attr-defined]
    module.init_model_parallel_group = guarded


_PATCHES = {_HOST_REGISTER: _patch_host_register, _PARALLEL_STATE: _patch_parallel_state}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _PATCHES[module.__name__](module)


class _HostRegisterGuardFinder(importlib.abc.MetaPathFinder):
    """Finds the target module with the normal finders, then wraps its loader so the patch runs after exec."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


if not any(isinstance(f, _HostRegisterGuardFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _HostRegisterGuardFinder())
for _name, _apply in _PATCHES.items():
    if _name in sys.modules:  # already imported (unusual): patch in place
        _apply(sys.modules[_name])
