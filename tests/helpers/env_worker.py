"""Per-rank body of the multi-turn test: the real Trainer with a real local mpo engine (fp32) and the scripted
two-turn environment; records every engine call, the samples collect() built and the old forward under R3, padded
and packed."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def two_turn(out_dir: str, overrides: list[str]) -> None:
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.trainer.loop import engine_set, publisher
    from mpo.trainer.rollouts import Rollouts
    from mpo.trainer.rows import rank_microbatches
    from mpo.trainer.trainer import Trainer

    config = load_config(RECIPES / "demo_cpu.yaml", [f"logging.out_dir={out_dir}", *overrides])
    trainer = Trainer(config)
    rollouts = Rollouts.beside(trainer)
    engines = engine_set(config, Path(out_dir))
    rollouts.collector.connect(engines.handles)
    calls = []
    weights = publisher(trainer, engines, rollouts)
    try:
        weights.publish(0)
        generate = rollouts.collector._generate

        def recorded(requests):
            results, restarts = generate(requests)
            calls.append([{"input": list(q.input_ids), "output": r.output_ids, "logprobs": r.output_logprobs,
                           "routes": r.routed_experts.tolist() if r.routed_experts is not None else None}
                          for q, r in zip(requests, results)])
            return results, restarts

        rollouts.collector._generate = recorded
        samples, metrics = rollouts.collector.collect(0)
        mbs = rank_microbatches(samples, dp_rank=0, dp_size=1, micro_batch_size=len(samples))
        records, old_metrics = trainer.policy.old_forward(mbs)
        mb, record = mbs[0], records[0]
        # the same samples packed (sequence packing, block-diagonal mask on the local spec), under the same R3 replay
        from dataclasses import replace

        trainer.config = replace(config, schedule=replace(config.schedule, max_tokens_per_microbatch=512))
        packed = trainer.pass_microbatches([samples])[0]
        trainer.policy.old_forward(packed)
        trainer.config = config
        by_sample = {id(ps): (pmb, j) for pmb in packed for j, ps in enumerate(pmb.extras["samples"])}
        rows = []
        for i, s in enumerate(samples):
            n = len(s.ids)
            rows.append({"ids": s.ids, "prompt_len": s.prompt_len, "loss_mask": s.loss_mask,
                         "rollout_logprobs": s.rollout_logprobs, "reward": s.reward,
                         "versions": None if s.versions is None else [int(v) for v in s.versions],  # numpy on rank 0
                         "trainer_logprobs": mb.extras["logp_old"][i, s.prompt_len:n].tolist(),
                         "batch_mask": mb.extras["mask"][i, s.prompt_len:n].tolist(),
                         "packed_logprobs": by_sample[id(s)][0].extras["logp_old"][by_sample[id(s)][1],
                                                                                  s.prompt_len:n].tolist(),
                         "packed_mask": by_sample[id(s)][0].extras["mask"][by_sample[id(s)][1], s.prompt_len:n].tolist(),
                         "engine_routes": s.routes.tolist(),
                         "replayed": record.indices[i, :n - 1].to(torch.int64).tolist(),
                         "natural": record.natural_choice().indices[i, :n - 1].to(torch.int64).tolist()})
        Path(out_dir, "two_turn.json").write_text(json.dumps({"calls": calls, "rows": rows, "metrics": metrics,
                                                             "old_metrics": old_metrics}))
    finally:
        weights.close()  # its weight-update session, before the engines stop
        engines.stop()
        rollouts.close()
    torch.distributed.destroy_process_group()
