"""The few named switches that differ between a GPU cluster and a CPU box. Everything else is one code path.

The layer spec: Transformer Engine on GPU when it is importable, else megatron-core's local spec (torch modules; what
the offline GPU tier runs, since TE cannot travel to a machine without network). `MPO_LAYER_SPEC=local|te` overrides
the choice; `te` on a machine without CUDA or without an importable TE is an error, never a silent fallback.

The local spec's two fast paths (docs/gpu_fast_paths.md):
* attention (`DeviceProfile.attention`): "sdpa" (mpo.models.sdpa_attention: torch SDPA, flash / memory-efficient
  kernels, no s x s scores per head) on a GPU, "local" (megatron's unfused DotProductAttention) on the CPU, where it
  keeps the CPU path's numerics bit-identical to megatron's and its short-row softmax speed-up
  (mpo.models.short_softmax); "te" under Transformer Engine. `MPO_ATTENTION=sdpa|local` overrides on the local spec.
* experts (`grouped_mm_dtypes`): mpo.models.lean_local.GroupedSequentialMLP runs all experts as two
  `torch._grouped_mm` calls where torch's grouped GEMM takes the device and dtype, else megatron's per-expert loop.
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
ATTENTIONS = ("sdpa", "local")
# torch 2.14's grouped GEMM on CUDA (torch.nn.functional.grouped_mm's docstring and its meta checks): bf16 inputs on
# compute capability >= 8.0 (fp16 only with cuBLASLt >= 13.3 on 9.x-11.x, not relied on); ROCm is not claimed.
GROUPED_MM_MIN_CAPABILITY = (8, 0)
ATTENTION_LINES = {"te": "attention: Transformer Engine (fused)",
                   "sdpa": "attention: torch SDPA (flash / memory-efficient kernels)",
                   "local": "attention: megatron local (unfused)"}


@dataclass(frozen=True)
class DeviceProfile:
    """Where the job runs and the settings that follow from it.

    Attributes:
        device: torch device of this rank's compute.
        backend: torch.distributed backend: "nccl" on GPU, "gloo" on CPU.
        layer_spec: megatron-core layer spec: "te" (Transformer Engine) on GPU when TE is importable, "local" (torch
            modules) on CPU and on a GPU without TE (see the module docstring, `MPO_LAYER_SPEC`).
        cpu_initialization: megatron `use_cpu_initialization`; required on CPU, where CUDA init paths do not exist.
        attention: the core attention: "te" with the TE spec, else "sdpa" (torch SDPA) or "local" (megatron's
            unfused DotProductAttention); None = `choose_attention` (module docstring, `MPO_ATTENTION`).
    """

    device: torch.device
    backend: Literal["nccl", "gloo"]
    layer_spec: Literal["te", "local"]
    cpu_initialization: bool
    attention: Literal["te", "sdpa", "local"] | None = None

    def __post_init__(self) -> None:
        if self.attention is None:
            object.__setattr__(self, "attention", choose_attention(self.layer_spec, self.is_gpu))

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    def fast_path_lines(self, dtype: torch.dtype) -> tuple[str, str]:
        """The two lines saying which attention and which expert computation run for parameters of `dtype`."""
        if self.layer_spec == "te":
            return ATTENTION_LINES["te"], "experts: Transformer Engine grouped GEMM"
        if dtype in grouped_mm_dtypes(self.device):
            experts = f"experts: torch grouped GEMM ({self.device.type} {str(dtype).removeprefix('torch.')})"
        else:
            experts = (f"experts: megatron per-expert loop (no torch grouped GEMM for "
                       f"{str(dtype).removeprefix('torch.')} on {self.device})")
        return ATTENTION_LINES[self.attention], experts


def choose_attention(layer_spec: str, is_gpu: bool) -> Literal["te", "sdpa", "local"]:
    """The core attention: TE's under the TE spec; on the local spec MPO_ATTENTION if set, else SDPA on a GPU and
    megatron's on the CPU (module docstring)."""
    wanted = os.environ.get("MPO_ATTENTION", "").strip().lower()
    if wanted and wanted not in ATTENTIONS:
        raise ValueError(f"MPO_ATTENTION={wanted!r}; valid values: {', '.join(ATTENTIONS)}")
    if layer_spec == "te":
        if wanted:
            raise ValueError(f"MPO_ATTENTION={wanted} applies to the local layer spec; this process runs "
                             "Transformer Engine's (set MPO_LAYER_SPEC=local as well, or unset MPO_ATTENTION)")
        return "te"
    return wanted or ("sdpa" if is_gpu else "local")  # type: ignore[return-value]


def grouped_mm_dtypes(device: torch.device, capability: tuple[int, int] | None = None) -> frozenset[torch.dtype]:
    """The parameter dtypes for which torch's grouped GEMM runs the experts on `device` (see GROUPED_MM_MIN_CAPABILITY;
    on the CPU the dtypes mpo trains in). `capability`: the CUDA compute capability, else asked of the device."""
    if device.type == "cpu":
        return frozenset({torch.float32, torch.bfloat16})
    if device.type != "cuda" or torch.version.hip is not None:
        return frozenset()
    if capability is None:
        capability = _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())
    return frozenset({torch.bfloat16}) if tuple(capability) >= GROUPED_MM_MIN_CAPABILITY else frozenset()


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def skip_torch_compile_without_gpu() -> None:
    """Without a GPU, switch torch.compile off (TORCHDYNAMO_DISABLE=1, torch's own switch) for this process and the
    processes it starts; call before megatron-core is imported. megatron wraps its fused activations in
    torch.compile when imported (megatron.core.jit), and building those wrappers imports and configures inductor:
    seconds of CPU time in every rank and engine for kernels the CPU path never calls (its fusions are off; see
    mpo.models.builder). A value already set is kept."""
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
