"""Start-up messages a user cannot act on, dropped by logger and message (nothing else from those loggers is).

- megatron's "GPTModel IS DEPRECATED": mpo builds GPTModel on purpose (its HybridModel replacement has no MoE
  conversion mapping here yet).
- megatron's "MCore's async save is deprecated": megatron logs it for every torch_dist save, synchronous ones too
  (its sync save goes through the async path); NVRx is not a dependency of mpo.
- torch's "No CUDA runtime is found, using CUDA_HOME=...": logged on import on every CPU host with a CUDA_HOME.
What mpo does use instead (layer spec, precision, optimizer path) is said in one line by the trainer at start-up.
"""

from __future__ import annotations

import logging

NOISE = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> None:
    """Idempotent: one filter per noisy logger."""
    for name, prefix in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))
