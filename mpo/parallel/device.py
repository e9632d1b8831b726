"""The few named switches that differ between a GPU cluster and a CPU box. Everything else is one code path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class DeviceProfile:
    """Where the job runs and the settings that follow from it.

    Attributes:
        device: torch device of this rank's compute.
        backend: torch.distributed backend: "nccl" on GPU, "gloo" on CPU.
        layer_spec: megatron-core layer spec: "te" (Transformer Engine) on GPU, "local" (torch modules) on CPU.
        cpu_initialization: megatron `use_cpu_initialization`; required on CPU, where CUDA init paths do not exist.
    """

    device: torch.device
    backend: Literal["nccl", "gloo"]
    layer_spec: Literal["te", "local"]
    cpu_initialization: bool

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"


def detect_device(local_rank: int = 0, force_cpu: bool = False) -> DeviceProfile:
    """GPU profile when CUDA is available (and not forced off), else the CPU profile."""
    if torch.cuda.is_available() and not force_cpu:
        return DeviceProfile(torch.device("cuda", local_rank), "nccl", "te", cpu_initialization=False)
    return DeviceProfile(torch.device("cpu"), "gloo", "local", cpu_initialization=True)
