"""The policy's passes of one step (every rank): the old-logprob forward (engine routes placed, R3 replayed, the KL
reference scored), the loss with its global denominators (the rollout correction applied once per micro-batch), the
backward and the optimizer step, skipped when the loss or a gradient is not finite."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mpo.algorithms import (CorrectionConfig, PolicyBatch, all_reduce_metrics, apply_rollout_correction,
                            compute_global_denominators, compute_policy_loss, correction_counts, merge_metrics,
                            positive_nll)
from mpo.models.chunks import as_chunks
from mpo.models.forward import MicroBatch, join_rows, joined, run_microbatches
from mpo.parallel.collectives import all_reduce_


@dataclass
class PolicyUpdate:
    """The trainer's parts one update needs (made anew by Trainer.set_algorithm: the loss, the correction and the KL
    reference belong to the algorithm section). `model` is the DDP-wrapped policy megatron's schedule runs, `gpt` its
    unwrapped GPTModel (the KL reference's weights are swapped into it), `reference` the KL reference (host) or None."""

    model: Any
    gpt: torch.nn.Module
    optimizer: Any
    routing: Any
    model_cfg: Any
    algorithm: Any
    loss_spec: Any
    loss_cfg: Any
    correction: CorrectionConfig
    reference: dict[str, torch.Tensor] | None
    device: torch.device
    dp_group: Any
    pp_group: Any
    clock: Any
    forward_rows: int | None = None  # schedule.forward_micro_batch_size: rows per forward of the old-logprob pass

    def engine_routes(self, mb: MicroBatch):
        from mpo.routing import RolloutRoutes, place_rollout_routes

        rows = [[RolloutRoutes(torch.from_numpy(s.routes), len(s.ids))] if s.routes is not None else []
                for s in mb.extras["samples"]]
        if not any(rows):
            return None
        seq = mb.input_ids.shape[1]
        # the routes' layers: a stage's own once distributed (mpo.trainer.distribute), else every engine layer
        first = next(s for s in mb.extras["samples"] if s.routes is not None)
        for i, row in enumerate(rows):
            if not row:  # padding row: no engine record; -1 routes it naturally
                n = len(mb.extras["samples"][i].ids)
                shape = (n - 1, first.routes.shape[1], self.model_cfg.router_topk)
                rows[i] = [RolloutRoutes(torch.full(shape, -1, dtype=torch.int32), n)]
        if mb.packing is not None:  # the samples end to end in one row
            rows = [[seq for row in rows for seq in row]]
        return place_rollout_routes(rows, seq, first.route_layers)

    def old_forward(self, microbatches: list[MicroBatch]) -> tuple[list, dict[str, float]]:
        from mpo.routing import MicroBatchRouting, agreement_metrics, replay_forced_metrics

        vocab = self.model_cfg.vocab_size
        # Engine routes of this stage's layers, placed once per micro-batch: R3 replays them here and in the updates.
        for mb in microbatches:
            routes = self.engine_routes(mb)
            # placed on the host from the engine's arrays and kept there for the step (pinned where CUDA runs):
            # replay and the metrics move one micro-batch's layers at a time to the compute device
            mb.extras["engine_routes"] = None if routes is None else routes.select(self.routing.layers).to_host()
        engine_routes = [mb.extras["engine_routes"] for mb in microbatches]
        replay = None
        if self.algorithm.replay == "r3":
            if any(r is None for r in engine_routes):
                raise RuntimeError("algorithm.replay=r3 but the engines returned no routed experts")
            replay = engine_routes
        groups = self.forward_groups(microbatches)
        forward = [microbatches[g[0]] if len(g) == 1 else joined([microbatches[i] for i in g]) for g in groups]
        if replay is not None:
            replay = [replay[g[0]] if len(g) == 1 else
                      MicroBatchRouting.join([replay[i] for i in g], mb.input_ids.shape[1])
                      for g, mb in zip(groups, forward)]
        with self.routing.session(replay=replay) as old:
            joined_outs = run_microbatches(self.model, forward, vocab_size=vocab, forward_only=True)
        outs, records = _split_joined(groups, microbatches, joined_outs, old.records)
        metrics: dict[str, float] = {}
        outs_ref = self.reference_logprobs(microbatches) if self.reference is not None else None
        for i, mb in enumerate(microbatches if outs else []):
            mb.extras["logp_old"] = outs[i]["logprobs"]
            if outs_ref is not None:
                mb.extras["logp_ref"] = outs_ref[i]
        valid = [mb.model_layout(mb.extras["mask"]).bool() for mb in microbatches]  # as the routing records
        layers = {"num_layers": self.model_cfg.num_layers, "pp_group": self.pp_group}
        if all(r is not None for r in engine_routes):
            # Against the trainer's natural choice: under R3 the replayed experts equal the engine's by construction.
            metrics.update(agreement_metrics(engine_routes, [r.natural_choice() for r in records], valid,
                                             prefix="routing/rollout_vs_old", **layers))
        metrics.update(replay_forced_metrics(records, valid, prefix="routing/old_replay", **layers))
        if outs:  # train-vs-rollout log-prob mismatch, over the loss tokens
            diff = torch.zeros(2, dtype=torch.float64, device=self.device)
            for mb in microbatches:
                m = mb.extras["mask"]
                diff[0] += ((mb.extras["logp_old"] - mb.extras["rollout_logprobs"]).abs() * m).sum()
                diff[1] += m.sum()
            all_reduce_(diff, group=self.dp_group)
            metrics["train_rollout_logprob_absdiff"] = (diff[0] / diff[1].clamp(min=1)).item()
        return records, metrics

    def forward_groups(self, microbatches: list[MicroBatch]) -> list[list[int]]:
        """The old-logprob pass's forwards: consecutive micro-batches joined up to `forward_rows` rows (right-padded
        rows, one pipeline stage: megatron's stage buffers take one shape per pass), else one forward each."""
        from megatron.core import parallel_state

        if (self.forward_rows is None or parallel_state.get_pipeline_model_parallel_world_size() > 1
                or any(mb.packing is not None or mb.position_ids is not None for mb in microbatches)):
            return [[i] for i in range(len(microbatches))]
        return join_rows(microbatches, self.forward_rows)

    def reference_logprobs(self, microbatches: list[MicroBatch]) -> list[torch.Tensor]:
        current = {k: v.detach().clone() for k, v in self.gpt.state_dict().items() if isinstance(v, torch.Tensor)}
        self.gpt.load_state_dict(self.reference, strict=False)
        try:
            outs = run_microbatches(self.model, microbatches, vocab_size=self.model_cfg.vocab_size, forward_only=True)
        finally:
            self.gpt.load_state_dict(current, strict=False)
        return [o["logprobs"] for o in outs]

    def router_shifts(self, microbatches: list[MicroBatch], old_records: list, replay: list | None) -> None:
        """RSPO / +rs: gamma per token from the current router at the old experts (a forward-only probe pass, so the
        pipeline all-reduce happens outside megatron's schedule). The probe replays what the update replays: the
        router inputs of layer l depend on the experts used in layers < l, so gamma must come from the same routing
        as the update's forward (same weights, same routes: the same router log-probs)."""
        from mpo.routing import router_shift

        with self.routing.session(replay=replay, gather_at=old_records) as probe:
            run_microbatches(self.model, microbatches, vocab_size=self.model_cfg.vocab_size, forward_only=True)
        for mb, old, cur in zip(microbatches, old_records, probe.records):
            # host records (mpo.routing.records.host_copy): this micro-batch's on the device, where the loss reads it
            shift = router_shift(old.to(self.device), cur.to(self.device), self.loss_cfg.gamma_min,
                                 position_ids=mb.position_ids, pp_group=self.pp_group)
            if mb.packing is not None:  # gammas of the packed row -> the loss's sample layout
                shift = type(shift)(*(None if f is None else mb.packing.unpack(f) for f in
                                      (shift.log_gamma, shift.gamma_raw, shift.abs_logdiff)))
            mb.extras["router_shift"] = shift

    def loss_fn(self, denominators, positive_tokens: float):
        """The micro-batch loss: the policy loss (with the rollout correction that `loss_denominators` applied and
        its mismatch metrics, where the engine's log-probs are known) plus VAPO's positive-example NLL when enabled."""
        algo, name, cfg = self.algorithm, self.algorithm.loss, self.loss_cfg

        def loss_fn(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
            x = mb.extras
            corrected = x.get("correction")
            batch = PolicyBatch(logp_new=logprobs, logp_old=x["logp_old"], advantages=x["advantages"],
                                mask=x["mask"], group_ids=x["group_ids"], logp_ref=x.get("logp_ref"),
                                router_shift=x.get("router_shift"), entropy=entropy,
                                logp_rollout=x["rollout_logprobs"] if corrected is not None else None)
            out = compute_policy_loss(name, batch, cfg, denominators, correction=self.correction, corrected=corrected)
            loss, metrics = out.loss, dict(out.metrics)
            if algo.positive_nll_coef > 0:
                nll, nll_metrics = positive_nll(logprobs, x["mask"], x["rewards"], coef=algo.positive_nll_coef,
                                                threshold=algo.positive_nll_threshold,
                                                num_positive_tokens=positive_tokens)
                loss = loss + nll
                metrics.update(nll_metrics)
            return loss, {k: v.detach() for k, v in metrics.items()}

        return loss_fn

    def loss_denominators(self, microbatches: list[MicroBatch], num_groups: int):
        """Global denominators of one mini-batch: over the tokens the rollout correction keeps (where the engine's
        log-probs are known: the last pipeline stage, which computes the loss), and the positive-response token count
        of VAPO's NLL. Each micro-batch's correction, its metrics counted over the mini-batch, goes into its extras
        ("correction") for the loss. Collectives over the DP group."""
        real = [mb.extras["n_real"] for mb in microbatches]
        masks = [mb.extras["mask"][:n] for mb, n in zip(microbatches, real)]
        if all("logp_old" in mb.extras for mb in microbatches):
            # whole micro-batches (the loss's rows): padding rows have no loss tokens, so their part is zero
            corrections = [apply_rollout_correction(mb.extras["logp_old"], mb.extras["rollout_logprobs"],
                                                    mb.extras["mask"], self.correction) for mb in microbatches]
            counts = correction_counts(masks, corrections, self.dp_group)
            for mb, correction in zip(microbatches, corrections):
                mb.extras["correction"] = correction.counted(counts)
            masks = [c.mask_out[:n] for c, n in zip(corrections, real)]
        denominators = compute_global_denominators(
            masks, [mb.extras["group_ids"][:n] for mb, n in zip(microbatches, real)],
            [mb.extras["advantages"][:n] for mb, n in zip(microbatches, real)],
            num_groups=num_groups, process_group=self.dp_group)
        positive = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.algorithm.positive_nll_coef > 0:
            threshold = self.algorithm.positive_nll_threshold
            for mb in microbatches:
                positive += (mb.extras["mask"].bool() & (mb.extras["rewards"] >= threshold)[:, None]).sum()
            all_reduce_(positive, group=self.dp_group)
        return denominators, float(positive)

    def grads_finite(self, loss_ok: bool) -> bool:
        """Collective: True when the loss and every gradient are finite on every rank. megatron's DDP keeps every
        main_grad in a few contiguous buffers: one check per buffer, read back once (a check per parameter cost a
        host round trip each: hundreds per step for a Qwen3-30B-A3B stage)."""
        chunks = as_chunks(self.model)  # VPP: several DDP chunks (ModelChunks itself has nn.Module's buffers())
        ddp = all(isinstance(getattr(chunk, "buffers", None), list) for chunk in chunks)
        buffers = [b for chunk in chunks for b in (*chunk.buffers, *chunk.expert_parallel_buffers)] if ddp else []
        if buffers and all(b.grad_data is not None for b in buffers):
            grads = [b.grad_data for b in buffers]
        else:  # no grad buffers to read (not megatron's DDP, or released): each parameter's main_grad
            grads = [g for g in (getattr(p, "main_grad", None) for p in self.model.parameters()) if g is not None]
        flag = torch.tensor([0.0 if loss_ok else 1.0], device=self.device)
        # max |g| per buffer, a reduction with no buffer-sized temporary (isfinite(g) would be a bool per gradient
        # element); NaN or inf in any gradient makes it NaN or inf
        largest = [torch.linalg.vector_norm(g, float("inf")).float() for g in grads if g.numel()]
        if largest:
            flag = torch.maximum(flag, (~torch.isfinite(torch.stack(largest).max())).float().to(self.device))
        all_reduce_(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def update(self, microbatches: list[MicroBatch], old_records: list, num_groups: int,
               engine_routes: list | None) -> dict[str, float]:
        """One optimizer step on a mini-batch; metrics["nonfinite_skipped"] is 1.0 when it was skipped (a non-finite
        loss or gradient on any rank)."""
        from mpo.routing import agreement_metrics, replay_forced_metrics

        algo = self.algorithm
        denominators, positive_tokens = self.loss_denominators(microbatches, num_groups)
        replay = old_records if algo.replay == "r2" else engine_routes if algo.replay == "r3" else None
        if self.loss_spec.router_shift:
            self.router_shifts(microbatches, old_records, replay)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        with self.clock("forward_backward"), \
                self.routing.session(replay=replay, gather_at=old_records, backward=True) as current:
            outs = run_microbatches(self.model, microbatches, vocab_size=self.model_cfg.vocab_size,
                                    loss_fn=self.loss_fn(denominators, positive_tokens))
        metrics: dict[str, float] = {}
        loss_ok = True
        if outs:
            metric_names = [k for k in outs[0] if k not in ("logprobs", "entropy", "logits")]
            merged = merge_metrics([{k: o[k] for k in metric_names} for o in outs])
            merged = all_reduce_metrics(merged, self.dp_group)
            metrics = {k: float(v) for k, v in merged.items()}
            loss_ok = math.isfinite(metrics.get("loss", 0.0))
        valid = [mb.model_layout(mb.extras["mask"]).bool() for mb in microbatches]  # as the routing records
        layers = {"num_layers": self.model_cfg.num_layers, "pp_group": self.pp_group}
        natural = lambda records: [r.natural_choice() for r in records]  # noqa: E731 - what the routers chose
        metrics.update(agreement_metrics(natural(old_records), natural(current.records), valid,
                                         prefix="routing/old_vs_update", **layers))
        metrics.update(replay_forced_metrics(current.records, valid, prefix="routing/update_replay", **layers))
        finite = self.grads_finite(loss_ok)
        if finite:
            with self.clock("optimizer"):
                _, grad_norm, _ = self.optimizer.step()
            metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["nonfinite_skipped"] = 0.0 if finite else 1.0
        return metrics


def _split_joined(groups: list[list[int]], microbatches: list[MicroBatch], outs: list[dict],
                  records: list) -> tuple[list[dict], list]:
    """Per micro-batch outputs and routing records of a pass whose forwards joined `groups` of them: each one's rows
    and positions of its group's (unchanged where a group is a single micro-batch). Empty lists stay empty (a stage
    that is not the last has no outputs; a pass that records nothing has no records)."""
    split_outs, split_records = [], []
    for k, group in enumerate(groups):
        row = 0
        for i in group:
            b, s = microbatches[i].input_ids.shape
            if outs:
                split_outs.append(outs[k] if len(group) == 1 else
                                  {"logprobs": outs[k]["logprobs"][row:row + b, :s],
                                   "entropy": outs[k]["entropy"][row:row + b, :s]})
            if records:
                split_records.append(records[k] if len(group) == 1 else records[k].rows(row, row + b, s))
            row += b
    return split_outs, split_records
