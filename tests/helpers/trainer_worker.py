"""Per-rank body of the trainer tests: the real Trainer (2 gloo ranks, EP2) with a real local mpo engine."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

LOSS_ARGS = {"drgrpo": {"norm_const": 8.0}}


def _trainer(out_dir: str, overrides: list[str]):
    from mpo.config import RECIPES
    from mpo.config_checks import load_config
    from mpo.trainer.loop import engine_set
    from mpo.trainer.loop import publisher
    from mpo.trainer.rollouts import Rollouts
    from mpo.trainer.trainer import Trainer
    from mpo.trainer.warm_start import supervised_warm_start

    # A short warm start: rewards then vary within groups, so every loss sees non-zero advantages.
    # The demo recipe before its issue #17 tuning (loss gspo, lr 2e-3) and at its layout before issue #32 (2 ranks,
    # EP2): these tests' expectations were set with it.
    config = load_config(RECIPES / "demo_cpu.yaml", [f"logging.out_dir={out_dir}", "world_size=2",
                                                     "parallel.expert_parallel=2", "schedule.sft_steps=15",
                                                     "data.prompts_per_step=4", "algorithm.loss=gspo",
                                                     "schedule.lr=0.002", *overrides])
    trainer = Trainer(config)
    rollouts = Rollouts.beside(trainer)
    supervised_warm_start(trainer, rollouts.task)
    engines = engine_set(config, Path(out_dir)) if trainer.rank == 0 else None
    if engines is not None:
        rollouts.collector.connect(engines.handles)
    weights = publisher(trainer, engines, rollouts)
    weights.publish(0)
    return trainer, rollouts, engines, weights


def _use(trainer, rollouts, algorithm) -> None:
    """Trainer.set_algorithm with the rollout side following, as the run loop would."""
    trainer.set_algorithm(algorithm)
    rollouts.set_algorithm(trainer.config, trainer.advantages)


@contextmanager
def _worker_run(out_dir: str, name: str, overrides: list[str] = ()):
    """Trainer, its rollout side and engines for one worker; afterwards the engines stop and rank 0 writes `results`
    to <name>.json."""
    trainer, rollouts, engines, sync = _trainer(out_dir, list(overrides))
    results: dict = {}
    try:
        yield trainer, rollouts, engines, sync, results
    finally:
        sync.close()  # the publisher's weight-update session, before the engines stop
        if engines is not None:
            engines.stop()
    if trainer.rank == 0:
        Path(out_dir, f"{name}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def every_loss(out_dir: str, losses: list[str]) -> None:
    """One RL step per loss (plus KL once); the first step's train-vs-rollout log-prob diff is recorded."""
    from mpo.config import AlgorithmSection

    from helpers.sync_worker import forbid_full_gather

    with _worker_run(out_dir, "every_loss") as (trainer, rollouts, engines, sync, results), forbid_full_gather():
        # Every step and sync below runs with gather_full_state raising: the step loop never gathers the model.
        for step, loss in enumerate(losses):
            _use(trainer, rollouts, AlgorithmSection(loss=loss, loss_args=LOSS_ARGS.get(loss, {}),
                                                   filter_zero_variance=False))
            metrics = trainer.train_step(step, rollouts.collect)
            metrics.update(sync.publish(step + 1))
            results[loss] = metrics
        _use(trainer, rollouts, AlgorithmSection(loss="gspo", kl_coef=0.1, filter_zero_variance=False))
        results["gspo+kl"] = trainer.train_step(len(losses), rollouts.collect)
        results["gspo+kl"].update(sync.publish(99))
        # The engine dies between steps: the pool restarts it and it must serve the current weights.
        _use(trainer, rollouts, AlgorithmSection(loss="gspo", filter_zero_variance=False))
        if engines is not None:
            engines.processes[0].kill()
        results["after_engine_crash"] = trainer.train_step(len(losses) + 1, rollouts.collect)


ALGORITHMS_V2 = {  # name -> AlgorithmSection fields (one RL step each)
    **{f"advantage-{a}": {"advantage": a} for a in ("maxrl", "reinforce_pp", "reinforce_pp_baseline",
                                                     "reinforce_ema")},
    **{f"correction-{c}": {"loss": "grpo", "rollout_correction": c}
       for c in ("tis_token", "tis_seq", "icepop_token", "mis_seq")},
    "correction-mis_seq-gspo": {"loss": "gspo", "rollout_correction": "mis_seq",
                                "rollout_correction_args": {"lower": 0.995, "upper": 1.005}},
    "dppo_kl-anchor_rollout": {"loss": "dppo_kl", "loss_args": {"anchor": "rollout"}},
    "positive_nll": {"loss": "dapo", "positive_nll_coef": 0.1, "positive_nll_threshold": 1e-6},  # any credit
    "kl-k3_unbiased": {"loss": "gspo", "kl_coef": 0.1, "kl_estimator": "k3_unbiased"},
    "ppo-gae": {"loss": "grpo", "advantage": "gae", "advantage_args": {"lam": 0.95}},
    "vapo": {"loss": "dapo", "advantage": "vapo", "positive_nll_coef": 0.1, "positive_nll_threshold": 1e-6},
}


def algorithms_v2(out_dir: str, layout: list[str] = ()) -> None:
    """One RL step per second-wave estimator, rollout correction and loss term, at the demo's layout or `layout`.
    The engine runs in bf16 and is synced after every step, so the corrections see a real, bounded mismatch (as
    between an inference engine's kernels and the trainer's)."""
    from mpo.config import AlgorithmSection

    with _worker_run(out_dir, "algorithms_v2", ["rollout.engine_dtype=bf16", *layout]) as (
            trainer, rollouts, engines, sync, results):
        for step, (name, fields) in enumerate(ALGORITHMS_V2.items()):
            _use(trainer, rollouts, AlgorithmSection(filter_zero_variance=False, **fields))
            results[name] = trainer.train_step(step, rollouts.collect)
            sync.publish(step + 1)
            if fields.get("advantage") == "reinforce_ema":
                results["ema_state"] = trainer.advantages.state_dict()


def replay_modes(out_dir: str) -> None:
    """An fp32 engine, first in sync (R3 then reproduces its log-probs), then left behind as in one-step off-policy
    (asynchronous) RL: no weight sync between steps, so its routing drifts from the trainer's natural choice. The
    last step runs RSPO under R3 and records, for every micro-batch, the gamma the loss used (from the probe pass)
    next to the gamma of the update's own replayed forward."""
    from mpo.config import AlgorithmSection
    from mpo.routing import router_shift

    with _worker_run(out_dir, "replay") as (trainer, rollouts, _, _, results):
        for step, mode in enumerate(("r3_in_sync", "none", "r3", "r2")):
            _use(trainer, rollouts, AlgorithmSection(loss="gspo", replay=mode.removesuffix("_in_sync"),
                                                   filter_zero_variance=False))
            results[mode] = trainer.train_step(step, rollouts.collect)
        sessions = _record_sessions(trainer)
        _use(trainer, rollouts, AlgorithmSection(loss="rspo", replay="r3", filter_zero_variance=False))
        results["rspo_r3"] = trainer.train_step(4, rollouts.collect)
        probe = next(r for kw, r in sessions if kw.get("gather_at") is not None and not kw.get("backward"))
        update = next((kw, r) for kw, r in sessions if kw.get("backward"))
        old = update[0]["gather_at"]
        diffs = [(router_shift(o, p, 0.0).gamma_raw - router_shift(o, u, 0.0).gamma_raw).abs().max().item()
                 for o, p, u in zip(old, probe.records, update[1].records, strict=True)]
        results["rspo_r3"]["gamma_probe_vs_update_maxdiff"] = max(diffs)


def _record_sessions(trainer) -> list:
    """Wrap trainer.routing.session so every session's arguments and result are kept (test instrumentation)."""
    from contextlib import contextmanager

    sessions: list = []
    original = trainer.routing.session

    @contextmanager
    def session(**kwargs):
        with original(**kwargs) as result:
            yield result
        sessions.append((kwargs, result))

    trainer.routing.session = session
    return sessions


def nonfinite(out_dir: str, where: str = "loss") -> None:
    """A numeric blow-up is skipped and counted; after max_nonfinite_steps in a row the run checkpoints and stops.
    Injected into the loss function, everything else the real loop: where="loss", the loss turns NaN on every rank;
    where="grad", the loss stays finite (0 more) and only rank 1's gradients turn infinite (sqrt'(0))."""
    from mpo.trainer.trainer import NonFiniteStop

    def blow_up(mb, logprobs, entropy):
        if where == "loss":
            return logprobs.sum() * float("nan"), {}
        zero = (logprobs - logprobs.detach()).sum()  # exactly 0, with gradient 1 for every log-prob
        rank = torch.distributed.get_rank()
        return logprobs.sum() + (torch.sqrt(zero) if rank == 1 else 0.0), {}

    overrides = ["schedule.max_nonfinite_steps=2", "schedule.updates_per_step=1", "algorithm.filter_zero_variance=false"]
    with _worker_run(out_dir, "nonfinite", overrides) as (trainer, rollouts, _, _, results):
        before = {k: v.clone() for k, v in trainer.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        trainer.policy.loss_fn = lambda *denominators: blow_up
        results["steps"] = []
        try:
            for step in range(3):
                results["steps"].append(trainer.train_step(step, rollouts.collect))
                trainer.stop_if_nonfinite(step + 1, rollouts.state_dict)
        except NonFiniteStop as exc:
            results["stopped"] = str(exc)
        after = trainer.gpt.state_dict()
        results["weights_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        results["checkpoint"] = str(trainer.checkpoints.latest())


def retirement(out_dir: str, steps: int) -> None:
    """Steps on 2-digit prompts (100 in all) with every seen prompt retired (threshold 0), a checkpoint, the retired
    set cleared and restored by resume(), more steps; then, as the control, as many steps without retirement. Rank 0
    records each step's prompts."""
    overrides = ["data.digits=2", "algorithm.filter_zero_variance=false", "data.retire_pass_rate=0.0"]
    with _worker_run(out_dir, "retirement", overrides) as (trainer, rollouts, _, _, results):
        sampled: list[list[list[int]]] = []
        collect = rollouts.collector.collect

        def collect_and_record(step):
            samples, metrics = collect(step)
            sampled.append(sorted({tuple(s.ids[: s.prompt_len]) for s in samples}))
            return samples, metrics

        for step in range(steps):
            trainer.train_step(step, collect_and_record)
        trainer.save(steps, rollouts.state_dict())
        retirement = rollouts.collector.retirement
        if retirement is not None:  # rank 0 samples prompts and holds the set
            results["retired_before_resume"] = len(retirement.retired)
            retirement.retired = set()  # what a new process starts with; resume() must bring it back
        start, rollout_state = trainer.resume()
        rollouts.load_state_dict(rollout_state)
        if retirement is not None:
            results["retired_after_resume"] = len(retirement.retired)
        for step in range(start, 2 * steps):
            trainer.train_step(step, collect_and_record)
        results["sampled"], sampled[:] = list(sampled), []
        rollouts.collector.retirement = None
        for step in range(100, 100 + 2 * steps):
            trainer.train_step(step, collect_and_record)
        results["sampled_without_retirement"] = sampled


def layout_step(out_dir: str, layout: list[str]) -> None:
    """One RL step at a given layout with variable-length prompts and responses (warm start included)."""
    with _worker_run(out_dir, "layout", ["parallel.expert_parallel=1", "schedule.sft_steps=2", *layout]) as (
            trainer, rollouts, _, _, results):
        results["step"] = trainer.train_step(0, rollouts.collect)


def critic_fits(out_dir: str, updates: int) -> None:
    """PPO's critic on one step's rollouts: old values and GAE returns once, then `updates` steps of the clipped value
    loss on the same micro-batches; rank 0 records the value loss of each (it must fall: the critic learns)."""
    from mpo.config import AlgorithmSection
    from mpo.trainer.rows import rank_microbatches

    with _worker_run(out_dir, "critic", ["algorithm.filter_zero_variance=false"]) as (
            trainer, rollouts, _, _, results):
        _use(trainer, rollouts, AlgorithmSection(loss="grpo", advantage="gae", filter_zero_variance=False,
                                               critic_lr=0.001, value_clip=10.0))
        samples, _ = rollouts.collector.collect(0) if trainer.rank == 0 else (None, {})
        box = [samples]
        torch.distributed.broadcast_object_list(box, src=0)
        dp_rank, dp_size = trainer._dp()
        mbs = rank_microbatches(box[0], dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=16)
        trainer.policy.old_forward(mbs)
        trainer.critic.advantages(mbs)
        results["value_loss"] = [trainer.critic.update(mbs)["critic/value_loss"] for _ in range(updates)]


def joined_old_pass(out_dir: str) -> None:
    """The old-logprob pass with its forwards joined (schedule.forward_micro_batch_size) against one forward per
    micro-batch, on the same micro-batches of different widths: rank 0 records, per replay mode, the largest
    log-prob and entropy difference, whether the routing records (chosen, natural) are equal, and the groups."""
    from mpo.config import AlgorithmSection
    from mpo.trainer.rows import rank_microbatches

    with _worker_run(out_dir, "joined", ["algorithm.filter_zero_variance=false"]) as (
            trainer, rollouts, _, _, results):
        samples, _ = rollouts.collector.collect(0) if trainer.rank == 0 else (None, {})
        box = [samples]
        torch.distributed.broadcast_object_list(box, src=0)
        dp_rank, dp_size = trainer._dp()
        half = len(box[0]) // 2
        narrow = rank_microbatches(box[0][:half], dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=4)
        wide = rank_microbatches(box[0][half:], dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=4,
                                 seq_len=narrow[0].input_ids.shape[1] + 3)  # padded 3 positions further
        mbs = [mb for pair in zip(narrow, wide) for mb in pair]  # each joined forward mixes the two widths
        for replay in ("none", "r3"):
            _use(trainer, rollouts, AlgorithmSection(loss="grpo", replay=replay, filter_zero_variance=False))
            runs = {}
            for rows in (None, 3, 8):
                trainer.policy.forward_rows = rows
                records, _ = trainer.policy.old_forward(mbs)
                runs[rows] = ([mb.extras["logp_old"].clone() for mb in mbs], records,
                              trainer.policy.forward_groups(mbs))
            base_logp, base_records, _ = runs[None]
            out = {"widths": [mb.input_ids.shape[1] for mb in mbs]}
            for rows in (3, 8):
                logp, records, groups = runs[rows]
                out[f"groups_{rows}"] = groups
                out[f"logp_maxdiff_{rows}"] = max((a - b).abs().max().item() for a, b in zip(logp, base_logp))
                out[f"logp_equal_{rows}"] = all(torch.equal(a, b) for a, b in zip(logp, base_logp))
                out[f"records_equal_{rows}"] = all(
                    torch.equal(a.indices, b.indices) and torch.equal(a.natural_choice().indices,
                                                                      b.natural_choice().indices)
                    and a.indices.shape == b.indices.shape for a, b in zip(records, base_records, strict=True))
            results[replay] = out
