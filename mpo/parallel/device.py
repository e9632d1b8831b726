"""The few named switches that differ between a GPU cluster and a CPU box. Everything else is one code path.

The layer spec: Transformer Engine on GPU when it is importable, else megatron-core's local spec (torch modules; what
the offline GPU tier runs, since TE cannot travel to a machine without network). `MPO_LAYER_SPEC=local|te` overrides
the choice; `te` on a machine without CUDA or without an importable TE is an error, never a silent fallback.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)
LAYER_SPECS = ("te", "local")


@dataclass(frozen=True)
class DeviceProfile:
    """Where the job runs and the settings that follow from it.

    Attributes:
        device: torch device of this rank's compute.
        backend: torch.distributed backend: "nccl" on GPU, "gloo" on CPU.
        layer_spec: megatron-core layer spec: "te" (Transformer Engine) on GPU when TE is importable, "local" (torch
            modules) on CPU and on a GPU without TE (see the module docstring, `MPO_LAYER_SPEC`).
        cpu_initialization: megatron `use_cpu_initialization`; required on CPU, where CUDA init paths do not exist.
    """

    device: torch.device
    backend: Literal["nccl", "gloo"]
    layer_spec: Literal["te", "local"]
    cpu_initialization: bool

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"


def skip_torch_compile_without_gpu() -> None:
    """Without a GPU, switch torch.compile off (TORCHDYNAMO_DISABLE=1, torch's own switch) for this process and the
    processes it starts; call before megatron-core is imported. megatron wraps its fused activations in
    torch.compile when imported (megatron.core.jit), and building those wrappers imports and configures inductor:
    ~1.3 s of CPU time in every rank and engine (measured: importing megatron.core 4.8 -> 3.5 s of CPU), for kernels
    the CPU path never calls (its fusions are off; see mpo.models.builder). A value already set is kept."""
    if "TORCHDYNAMO_DISABLE" not in os.environ and not torch.cuda.is_available():
        os.environ["TORCHDYNAMO_DISABLE"] = "1"


@functools.cache
def transformer_engine_problem() -> str | None:
    """None when Transformer Engine's PyTorch modules import, else why not (one line)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken build's OSError/RuntimeError
        return f"transformer_engine is not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    return None


def choose_layer_spec(is_gpu: bool) -> Literal["te", "local"]:
    """The layer spec for this process: MPO_LAYER_SPEC if set, else TE on GPU when importable, else local."""
    wanted = os.environ.get("MPO_LAYER_SPEC", "").strip().lower()
    if wanted and wanted not in LAYER_SPECS:
        raise ValueError(f"MPO_LAYER_SPEC={wanted!r}; valid values: {', '.join(LAYER_SPECS)}")
    if wanted == "local" or (not is_gpu and not wanted):
        return "local"
    if not is_gpu:
        raise ValueError("MPO_LAYER_SPEC=te needs a CUDA device (Transformer Engine runs on GPUs only)")
    problem = transformer_engine_problem()
    if problem is None:
        return "te"
    if wanted == "te":
        raise ValueError(f"MPO_LAYER_SPEC=te but {problem}")
    log.warning("%s: using megatron-core's local layer spec on the GPU (slower kernels, same numerics; "
                "MPO_LAYER_SPEC=te makes this an error)", problem)
    return "local"


def detect_device(local_rank: int = 0, force_cpu: bool = False) -> DeviceProfile:
    """GPU profile when CUDA is available (and not forced off), else the CPU profile."""
    if torch.cuda.is_available() and not force_cpu:
        return DeviceProfile(torch.device("cuda", local_rank), "nccl", choose_layer_spec(True),
                             cpu_initialization=False)
    return DeviceProfile(torch.device("cpu"), "gloo", choose_layer_spec(False), cpu_initialization=True)
