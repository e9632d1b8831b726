"""Rank body of test_gpu_rl_step: the real Trainer on one GPU (NCCL, world 1) for one RL step under R3.

Reuses the CPU trainer tests' harness (tests/helpers/trainer_worker: demo recipe, short supervised warm start,
first weight sync), with GPU overrides: bf16 body and FP32 LM head on the trainer and on the engine.
"""

from __future__ import annotations

import torch


def run(out_dir: str, name: str, overrides: list[str]) -> None:
    from helpers.trainer_worker import _worker_run

    with _worker_run(out_dir, name, overrides) as (trainer, rollouts, engines, sync, results):
        device = trainer.ctx.device
        results["device"] = {"device": str(device.device), "backend": device.backend, "spec": device.layer_spec,
                             "gpu": torch.cuda.get_device_name() if device.is_gpu else None}
        metrics = trainer.train_step(0, rollouts.collect)
        metrics.update(sync(trainer, engines, "v1"))
        results["step"] = metrics
