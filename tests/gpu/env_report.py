"""What the GPU machine is, as one JSON object on stdout (the offline tier's first step; read by results.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import sys


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def report() -> dict:
    import torch

    from mpo.parallel.device import choose_layer_spec, transformer_engine_problem

    cuda = torch.cuda.is_available()
    out = {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "megatron_core": _version("megatron-core"), "transformers": _version("transformers"),
        "transformer_engine": transformer_engine_problem() or _version("transformer-engine") or "importable",
        "sglang": _version("sglang") if importlib.util.find_spec("sglang") else None,
        "layer_spec": choose_layer_spec(cuda),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}")
    return out


if __name__ == "__main__":
    print(json.dumps(report(), indent=1))
