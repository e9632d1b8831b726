"""Verification after a sync (mpo.weight_sync says how). Takes the trainer's log-probs as input: imports no trainer.

The probe's comparison (check_probe, issue #45) must not kill a healthy bf16 run and must still catch wrong weights.
bf16 log-probs differ from an fp32 reference by ~1e-2 per token with outliers (docs/measurements.md), so a bound on the
maximum either kills healthy runs or is too loose to see much. A wrong tensor instead moves whole groups of tokens: a
dense tensor every token (the median), one expert's tensor the tokens routed to it (the median of that (layer, expert)
group). So bf16 fails on medians, overall and per routed group, bounded by dtype, and only warns on the maximum (drift);
fp32 on both sides has no noise to speak of and keeps a tight bound on every token.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.protocol import decode_routed_experts

log = logging.getLogger(__name__)


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of one tensor's values upcast to fp32 (exact for bf16), so a bf16 engine can be checked against an fp32
    trainer whose weights are rounded the way the engine stores them (see WeightSync.verify)."""
    data = tensor.detach().float().contiguous().cpu()  # no copy for a contiguous fp32 CPU tensor
    return hashlib.sha256(data.view(-1).view(torch.uint8).numpy() if data.numel() else b"").hexdigest()


def combine_digests(parts: Iterable[dict[str, str] | None]) -> str:
    """The weights checksum from per-tensor digests (maps of name -> digest, one per sender; None: a rank that sent
    nothing): sha256 over (name, digest) in name order. Order-free on the sending side: senders of a streaming sync
    hash their own buckets, and only the small digest maps meet on one rank (no full-model gather)."""
    digests: dict[str, str] = {}
    for part in parts:
        digests.update(part or {})
    combined = hashlib.sha256()
    for name in sorted(digests):
        combined.update(name.encode())
        combined.update(digests[name].encode())
    return combined.hexdigest()


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Checksum of HF-named tensors: equal iff every weight has the same value (combine_digests of tensor_digest)."""
    return combine_digests([{name: tensor_digest(tensor) for name, tensor in named}])


def verify_checksum(clients: Sequence[EngineClient], expected: str) -> None:
    """Every engine's /weights_checksum must equal `expected` (see combine_digests). Give the engines still in the
    session (WeightSync.live): one left out of it is restarted and streamed to again (mpo.weight_sync)."""
    for client in clients:
        got = client.call("/weights_checksum", method="GET")["checksum"]
        if got != expected:
            raise EngineError(client.url, "/weights_checksum", f"weights differ from the trainer's after sync "
                              f"(engine {got[:12]}, trainer {expected[:12]})", retryable=False)


def verify_by_probe(clients: Sequence[EngineClient], probes: Sequence[Sequence[int]],
                    trainer_logprobs: Sequence[Sequence[float]], *, tolerance: float = 1e-3) -> float:
    """SGLang engines (no weights checksum for MoE models): each engine's log-probs of every probe sequence must
    be within `tolerance` of the trainer's. `trainer_logprobs[j][i]` is log p(probes[j][i] | probes[j][:i]);
    position 0 has none and is ignored. Build `probes` with covering_probes, so that a stale expert anywhere
    changes some log-prob. Returns the largest |diff| over engines; raises EngineError naming the engine. A bound on
    every token: for fp32 on both sides (tests); runs compare with check_probe."""
    references = _references(probes, trainer_logprobs)
    worst = 0.0
    for client in clients:
        runs = run_probes(client, probes)
        diffs = [(torch.tensor(run.logprobs, dtype=torch.float64) - ref).abs() for run, ref in zip(runs, references)]
        per_probe = [d.max().item() if d.numel() else 0.0 for d in diffs]
        j = max(range(len(per_probe)), key=lambda k: (per_probe[k] != per_probe[k], per_probe[k]))  # NaN first
        diff = per_probe[j]
        if not diff <= tolerance:  # NaN fails too
            raise EngineError(client.url, "/generate", f"probe log-probs differ from the trainer's by {diff:.3g} "
                              f"(probe sequence {j} of {len(probes)}; tolerance {tolerance:g}) after weight sync",
                              retryable=False)
        worst = max(worst, diff)
    return worst


@dataclass(frozen=True)
class ProbeBounds:
    """When a probe comparison fails (a wrong tensor) or warns (drift); |diff| is per scored token, engine vs trainer.

    Attributes:
        median: fail when the median |diff| over every token exceeds it (a wrong dense tensor moves every token).
        group_median: fail when the median |diff| of the tokens an engine routed to one (layer, expert) exceeds
            max(group_median, group_ratio x the overall median) (a wrong expert moves its tokens).
        group_ratio: see group_median (a drifting run moves every group with the overall median).
        group_min_tokens: groups with fewer tokens are not judged (a median of 3 noisy tokens is noise); they are
            counted in the metrics (sync_probe_groups_unjudged).
        max: fail when any token's |diff| exceeds it (None: never; bf16 outliers are routine).
        warn_max: log a warning (drift) when the largest |diff| exceeds it.
    """

    median: float
    group_median: float
    group_ratio: float = 4.0
    group_min_tokens: int = 1
    max: float | None = None
    warn_max: float = float("inf")


# fp32 on both sides: no noise to speak of (the fp32 engine vs transformers: 1e-5). bf16 on either side: the numbers in
# docs/measurements.md (probe bounds), with room (x7 the healthy median; groups of 8+ tokens: a healthy group's median
# over 0.04 needs half its tokens past the 95th percentile).
PROBE_BOUNDS = {"fp32": ProbeBounds(median=1e-3, group_median=1e-3, max=1e-3, warn_max=1e-4),
                "bf16": ProbeBounds(median=0.05, group_median=0.04, group_min_tokens=8, warn_max=0.1)}


def probe_bounds(*dtypes: str) -> ProbeBounds:
    """The bounds for a comparison between sides computing in `dtypes` ("fp32" / "bf16"): bf16 if any side is."""
    return PROBE_BOUNDS["bf16" if "bf16" in dtypes else "fp32"]


def _probe_stats(diffs: np.ndarray, routes: np.ndarray | None, num_experts: int | None,
                 bounds: ProbeBounds) -> tuple[dict[str, float], str | None]:
    """Metrics of one engine's per-token |diff| (`routes`: [tokens, layers, K] the engine's, or None) and why it
    fails (None: it does not)."""
    finite = np.isfinite(diffs)
    median = float(np.median(diffs)) if diffs.size else 0.0
    stats = {"median": median, "q99": float(np.quantile(diffs, 0.99)) if diffs.size else 0.0,
             "max": float(diffs.max()) if diffs.size else 0.0, "worst_group_median": 0.0, "groups_unjudged": 0.0}
    if not finite.all():
        return stats, f"{int((~finite).sum())} probe log-probs are not finite"
    if median > bounds.median:
        return stats, f"median |diff| {median:.3g} over every token > {bounds.median:g}: a wrong tensor"
    worst = None
    if routes is not None and routes.size and num_experts:
        limit = max(bounds.group_median, bounds.group_ratio * median)
        for layer in range(routes.shape[1]):
            chosen = routes[:, layer]  # [tokens, K]
            for expert in np.unique(chosen[(chosen >= 0) & (chosen < num_experts)]):
                group = diffs[(chosen == expert).any(-1)]
                if len(group) < bounds.group_min_tokens:
                    stats["groups_unjudged"] += 1
                    continue
                value = float(np.median(group))
                if value > stats["worst_group_median"]:
                    stats["worst_group_median"], worst = value, (layer, int(expert), len(group))
        if worst is not None and stats["worst_group_median"] > limit:
            return stats, (f"median |diff| {stats['worst_group_median']:.3g} of the {worst[2]} tokens routed to layer "
                           f"{worst[0]} expert {worst[1]} > {limit:.3g} (overall median {median:.3g}): a wrong expert "
                           f"tensor")
    if bounds.max is not None and stats["max"] > bounds.max:
        return stats, f"max |diff| {stats['max']:.3g} > {bounds.max:g}"
    return stats, None


def check_probe(clients: Sequence[EngineClient], probes: Sequence[Sequence[int]],
                trainer_logprobs: Sequence[Sequence[float]], bounds: ProbeBounds, *, num_layers: int | None = None,
                topk: int | None = None, num_experts: int | None = None) -> dict[str, float]:
    """Every engine's log-probs of the probe against the trainer's (`trainer_logprobs[j][i]` = log p(probes[j][i] |
    probes[j][:i]); position 0 ignored) by robust statistics (ProbeBounds). With num_layers, topk and num_experts the
    engine's routes group the tokens per (layer, expert), so one wrong expert shows. Raises EngineError (one line,
    naming the engine) on a clear mismatch; logs a warning on drift. Returns the metrics (worst over engines):
    sync_probe_logprob_{maxdiff,median,q99,worst_group_median}, sync_probe_groups_unjudged."""
    references = _references(probes, trainer_logprobs)
    with_routes = None not in (num_layers, topk, num_experts)
    metrics: dict[str, float] = {}
    for client in clients:
        runs = run_probes(client, probes, num_layers=num_layers if with_routes else None,
                          topk=topk if with_routes else None)
        diffs = np.concatenate([np.abs(np.asarray(run.logprobs, dtype=np.float64) - ref.numpy())
                                for run, ref in zip(runs, references)] or [np.zeros(0)])
        routes = np.concatenate([run.routes for run in runs]) if with_routes and runs else None
        stats, failure = _probe_stats(diffs, routes, num_experts, bounds)
        if failure is not None:
            raise EngineError(client.url, "/generate", f"probe log-probs differ from the trainer's after weight sync: "
                              f"{failure} ({len(probes)} probe sequences, {diffs.size} tokens)", retryable=False)
        if stats["max"] > bounds.warn_max:
            log.warning("engine %s: probe log-probs drift from the trainer's (max |diff| %.3g, 99th percentile %.3g, "
                        "median %.3g; fails only on a median past %g)", client.url, stats["max"], stats["q99"],
                        stats["median"], bounds.median)
        for key, value in stats.items():
            name = f"sync_probe_logprob_{'maxdiff' if key == 'max' else key}" if key != "groups_unjudged" \
                else "sync_probe_groups_unjudged"
            metrics[name] = max(metrics.get(name, 0.0), value)
    return metrics


def _references(probes: Sequence[Sequence[int]], trainer_logprobs: Sequence[Sequence[float]]) -> list[torch.Tensor]:
    if len(trainer_logprobs) != len(probes):
        raise ValueError(f"trainer log-probs for {len(trainer_logprobs)} probe sequences, not {len(probes)}")
    references = []
    for j, (probe, logprobs) in enumerate(zip(probes, trainer_logprobs)):
        if len(logprobs) != len(probe):
            raise ValueError(f"{len(logprobs)} trainer log-probs for probe sequence {j} of {len(probe)} tokens")
        references.append(torch.tensor([float(x) for x in logprobs[1:]], dtype=torch.float64))
    return references


@dataclass
class ProbeRun:
    """One probe sequence as an engine scored it.

    Attributes:
        logprobs: log p(probe[i] | probe[:i]) for i >= 1.
        routes: int32 [n - 1, layers, top_k]: the experts the engine routed input position p < n - 1 to (the last
            token's routing only shapes the generated token, which is not compared), or None if not asked for.
    """

    logprobs: list[float]
    routes: np.ndarray | None = None


def run_probes(client: EngineClient, probes: Sequence[Sequence[int]], *, num_layers: int | None = None,
               topk: int | None = None) -> list[ProbeRun]:
    """Every probe sequence in one batched /generate (logprob_start_len=0, one greedy new token): the engine's
    log-probs of the probe tokens from meta_info.input_token_logprobs ([logprob, token_id, text] per input token;
    the first has no logprob) and, when num_layers and topk are given, its routed experts."""
    want_routes = num_layers is not None and topk is not None
    body = {"input_ids": [list(p) for p in probes], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    if want_routes:
        body["return_routed_experts"] = True
    replies = client.call("/generate", body)
    if not isinstance(replies, list) or len(replies) != len(probes):
        raise EngineError(client.url, "/generate", f"expected {len(probes)} responses to the batched probe, got "
                          f"{type(replies).__name__}", retryable=False)
    runs = []
    for j, (probe, reply) in enumerate(zip(probes, replies)):
        meta = reply.get("meta_info") or {}
        entries = meta.get("input_token_logprobs") or []
        if len(entries) != len(probe) or [int(e[1]) for e in entries] != list(probe):
            raise EngineError(client.url, "/generate", f"input_token_logprobs does not cover the {len(probe)}-token "
                              f"probe sequence {j} (got {len(entries)} entries)", retryable=False)
        routes = None
        if want_routes:
            if "routed_experts" not in meta:
                raise EngineError(client.url, "/generate", "no meta_info.routed_experts for the probe: start the "
                                  "engine with --enable-return-routed-experts", retryable=False)
            rows = len(probe) + len(reply.get("output_ids") or []) - 1
            try:
                routes = decode_routed_experts(meta["routed_experts"], rows=rows, num_layers=num_layers, topk=topk)
            except ValueError as exc:
                raise EngineError(client.url, "/generate", f"probe sequence {j}: {exc}", retryable=False) from exc
            routes = routes[: len(probe) - 1]
        runs.append(ProbeRun([float(e[0]) for e in entries[1:]], routes))
    return runs


def uncovered_experts(runs: Iterable[ProbeRun], num_experts: int,
                      moe_layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(layer, expert) pairs that no probe token was routed to; layers index the engine's layer axis (all of them
    when moe_layers is None, e.g. skip the dense first layers of DeepSeek-V3)."""
    seen: np.ndarray | None = None
    for run in runs:
        routes = run.routes
        if routes is None:
            raise ValueError("uncovered_experts needs probe runs with routes (run_probes(num_layers=, topk=))")
        if seen is None:
            seen = np.zeros((routes.shape[1], num_experts), dtype=bool)
        flat = routes.transpose(1, 0, 2).reshape(routes.shape[1], -1)  # [layers, tokens * top_k]
        valid = (flat >= 0) & (flat < num_experts)
        layer_index = np.broadcast_to(np.arange(flat.shape[0])[:, None], flat.shape)
        seen[layer_index[valid], flat[valid]] = True
    if seen is None:
        return []
    layers = range(seen.shape[0]) if moe_layers is None else moe_layers
    return [(layer, expert) for layer in layers for expert in range(num_experts) if not seen[layer, expert]]


@dataclass(frozen=True)
class ProbeCoverage:
    """How covering_probes extends a probe until every expert of every MoE layer is routed to at least once.

    Attributes:
        num_experts: routed experts per MoE layer.
        num_layers: layers on the engine's routed-experts axis (SGLang: all hidden layers).
        topk: experts per token.
        vocab_size: extension tokens are drawn from [1, vocab_size).
        moe_layers: the layers to cover (None: all); dense layers report no real routing.
        tokens_per_sequence: length of each added sequence (long enough that attention mixes many contexts).
        max_sequences: the bound on the probe (base sequences included); reaching it without coverage is an error.
        seed: seeds the added sequences (sequence k is the same on every call, so probes are reproducible).
        strict: reaching max_sequences without coverage raises; False: warns and verifies what is covered.
    """

    num_experts: int
    num_layers: int
    topk: int
    vocab_size: int
    moe_layers: tuple[int, ...] | None = None
    tokens_per_sequence: int = 64
    max_sequences: int = 64
    seed: int = 0
    strict: bool = True

    def extension(self, k: int) -> list[int]:
        """The k-th added sequence: tokens drawn uniformly from [1, vocab_size), independent of the schedule."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        return torch.randint(1, self.vocab_size, (self.tokens_per_sequence,), generator=generator).tolist()


def covering_probes(client: EngineClient, base: Sequence[Sequence[int]], coverage: ProbeCoverage) -> list[list[int]]:
    return covering_probe_runs(client, base, coverage)[0]


def covering_probe_runs(client: EngineClient, base: Sequence[Sequence[int]],
                        coverage: ProbeCoverage) -> tuple[list[list[int]], list[ProbeRun], int]:
    """The base probe sequences, extended with deterministic pseudo-random sequences until the engine's own routed
    experts touch every (MoE layer, expert): a stale expert then changes the log-prob of some probe token. Each
    round doubles the probe (one batched /generate per round). Returns the probes, the engine's runs of every
    probe sequence (their routes: what the trainer replays) and the number of (layer, expert) pairs left uncovered.
    Raises EngineError naming the engine and the first uncovered pairs when max_sequences are not enough
    (coverage.strict); else logs a warning naming sync.probe_max_sequences and verifies what the probe covers (a
    trained model may have experts its router never picks: the run must not die of it)."""
    probes = [list(p) for p in base]
    if not probes:
        probes = [coverage.extension(0)]
    runs = run_probes(client, probes, num_layers=coverage.num_layers, topk=coverage.topk)
    missing = uncovered_experts(runs, coverage.num_experts, coverage.moe_layers)
    added = 0
    while missing:
        room = coverage.max_sequences - len(probes)
        if room <= 0:
            shown = ", ".join(f"layer {layer} expert {expert}" for layer, expert in missing[:5])
            if not coverage.strict:
                log.warning("engine %s: a probe of %d sequences leaves %d (layer, expert) pairs never routed to "
                            "(%s%s): they are not verified; raise sync.probe_max_sequences (now %d) to cover them",
                            client.url, len(probes), len(missing), shown, ", ..." if len(missing) > 5 else "",
                            coverage.max_sequences)
                break
            raise EngineError(client.url, "/generate", f"probe of {len(probes)} sequences "
                              f"({sum(map(len, probes))} tokens) leaves {len(missing)} (layer, expert) pairs never "
                              f"routed to ({shown}{', ...' if len(missing) > 5 else ''}); raise "
                              f"ProbeCoverage.max_sequences (now {coverage.max_sequences})", retryable=False)
        new = [coverage.extension(added + 1 + i) for i in range(min(len(probes), room))]
        added += len(new)
        runs += run_probes(client, new, num_layers=coverage.num_layers, topk=coverage.topk)
        probes += new
        missing = uncovered_experts(runs, coverage.num_experts, coverage.moe_layers)
    return probes, runs, len(missing)
