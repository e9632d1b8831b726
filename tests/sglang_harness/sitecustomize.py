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
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"
_FUNC = "_cuda_host_register"


def _patch(module) -> None:
    original = getattr(module, _FUNC, None)
    if original is None or getattr(original, "_mpo_cpu_guard", False):
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        import torch

        if not torch.cuda.is_available():
            return None  # no GPU: leave host memory unpinned
        return original(*args, **kwargs)

    guarded._mpo_cpu_guard = True  # type: ignore[attr-defined]
    setattr(module, _FUNC, guarded)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _HostRegisterGuardFinder(importlib.abc.MetaPathFinder):
    """Finds the target module with the normal finders, then wraps its loader so the patch runs after exec."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


if not any(isinstance(f, _HostRegisterGuardFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _HostRegisterGuardFinder())
if _TARGET in sys.modules:  # already imported (unusual): patch in place
    _patch(sys.modules[_TARGET])
