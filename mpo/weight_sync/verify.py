"""Verification after a sync (see mpo.weight_sync): weights checksums from per-tensor digests (mpo's engine) and
log-probs of a probe that covers every expert (SGLang). Takes the trainer's log-probs as input: imports no trainer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.protocol import decode_routed_experts


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
    changes some log-prob. Returns the largest |diff| over engines; raises EngineError naming the engine."""
    if len(trainer_logprobs) != len(probes):
        raise ValueError(f"trainer log-probs for {len(trainer_logprobs)} probe sequences, not {len(probes)}")
    references = []
    for j, (probe, logprobs) in enumerate(zip(probes, trainer_logprobs)):
        if len(logprobs) != len(probe):
            raise ValueError(f"{len(logprobs)} trainer log-probs for probe sequence {j} of {len(probe)} tokens")
        references.append(torch.tensor([float(x) for x in logprobs[1:]], dtype=torch.float64))
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
    """

    num_experts: int
    num_layers: int
    topk: int
    vocab_size: int
    moe_layers: tuple[int, ...] | None = None
    tokens_per_sequence: int = 64
    max_sequences: int = 64
    seed: int = 0

    def extension(self, k: int) -> list[int]:
        """The k-th added sequence: tokens drawn uniformly from [1, vocab_size), independent of the schedule."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        return torch.randint(1, self.vocab_size, (self.tokens_per_sequence,), generator=generator).tolist()


def covering_probes(client: EngineClient, base: Sequence[Sequence[int]], coverage: ProbeCoverage) -> list[list[int]]:
    """The base probe sequences, extended with deterministic pseudo-random sequences until the engine's own routed
    experts touch every (MoE layer, expert): a stale expert then changes the log-prob of some probe token. Each
    round doubles the probe (one batched /generate per round). Raises EngineError naming the engine and the first
    uncovered pairs when max_sequences are not enough."""
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
            raise EngineError(client.url, "/generate", f"probe of {len(probes)} sequences "
                              f"({sum(map(len, probes))} tokens) leaves {len(missing)} (layer, expert) pairs never "
                              f"routed to ({shown}{', ...' if len(missing) > 5 else ''}); raise "
                              f"ProbeCoverage.max_sequences (now {coverage.max_sequences})", retryable=False)
        new = [coverage.extension(added + 1 + i) for i in range(min(len(probes), room))]
        added += len(new)
        runs += run_probes(client, new, num_layers=coverage.num_layers, topk=coverage.topk)
        probes += new
        missing = uncovered_experts(runs, coverage.num_experts, coverage.moe_layers)
    return probes
