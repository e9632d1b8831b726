"""Start-up messages a user cannot act on, dropped by logger and message (nothing else from those loggers is).

- megatron's "GPTModel IS DEPRECATED": mpo builds GPTModel on purpose (its HybridModel replacement has no MoE
  conversion mapping here yet).
- megatron's "MCore's async save is deprecated": megatron logs it for every torch_dist save, synchronous ones too
  (its sync save goes through the async path); NVRx is not a dependency of mpo.
- torch's "No CUDA runtime is found, using CUDA_HOME=...": logged on import on every CPU host with a CUDA_HOME.
What mpo does use instead (layer spec, precision, optimizer path) is said in one line by the trainer at start-up.

And megatron's import-time `warnings.warn` notices (WARNINGS), which opened every trainer log and every script using
the Python API (`mpo train` also sets PYTHONWARNINGS=ignore for its ranks; the launcher and a user's script do not):
- "Transformer Engine and Apex are not installed" / "Apex is not installed" (CPU hosts, and GPU images without Apex:
  mpo's layer spec and optimizer are chosen on purpose, and said in the start-up line);
- "full scope is deprecated" (megatron's own TransformerConfig default, not a setting of mpo's);
- "MimoModelConfig is experimental" (a megatron model family imported on the way, unused by mpo).
- torch's distributed-checkpoint notices on megatron's calls: "torch.distributed is disabled ... assuming the intent
  is to load in a single process" (checkpoints_tools and scripts reading a checkpoint without a process group, on
  purpose), "The argument order of load has been changed" (megatron's call), and the FutureWarning "Please use
  DTensor instead and we are deprecating ShardedTensor" (megatron's checkpoint format); at TP2 megatron's
  CUDA_DEVICE_MAX_CONNECTIONS advice (a CUDA scheduling hint for overlapped tensor-parallel communication: nothing to
  do on a CPU, and on a GPU its absence costs overlap, not correctness) and torch's FutureWarning on megatron's
  `all_gather_into_tensor` call.
Filtered by message, as UserWarnings (FutureWarnings for FUTURE_WARNINGS) only: any other warning still shows.
"""

from __future__ import annotations

import logging
import warnings

NOISE = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "MimoModelConfig is experimental",
    "torch.distributed is disabled, unavailable or uninitialized",
    "The argument order of load has been changed",
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
FUTURE_WARNINGS = ("Please use DTensor instead and we are deprecating ShardedTensor",
                   "`torch.distributed.all_gather_into_tensor` is deprecated")


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> None:
    """Idempotent: one filter per noisy logger, one per noisy warning."""
    for name, prefix in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))
    for prefix in WARNINGS:  # warnings.filterwarnings drops an identical filter before adding it again
        warnings.filterwarnings("ignore", message=prefix, category=UserWarning)
    for prefix in FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=prefix, category=FutureWarning)
