"""mpo's engine against Hugging Face `transformers` loading the same files itself.

The engine (a real server process, real HTTP, preset "tiny") loads a random Qwen3-MoE checkpoint saved by
`transformers` itself (`/update_weights_from_disk`), and later perturbed copies of it pushed by WeightSync. The
reference is `Qwen3MoeForCausalLM` (fp32) loaded from the same files by `from_pretrained`: its log-softmax gives the
log-probs, its router logits (`output_router_logits=True`, top-k per layer) the routes. Nothing is faked. Since issue
#32 the engine computes with transformers' modeling too (mpo.engine.model), so what this checks is everything around
it: mpo's loading of per-expert checkpoint names into transformers' fused expert weights (the reference goes through
transformers' own weight conversion), the weight-update endpoints, the KV-cached decode and the server (the
reference runs uncached, with eager attention and eager experts where the engine runs SDPA and grouped matmuls). The
engine's forward against an implementation that shares no code with it (megatron-core's, the trainer's) is
tests/test_engine_kv_cache.py.

It also proves that probe verification catches a stale expert: a sync that skips one expert of one layer passes a
short probe that never routes to that expert, and fails the covering probe (mpo.weight_sync.verify.covering_probes)
built from the engine's own routed experts; the engine's checksum (mpo.weight_sync.verify.verify_checksum)
fails as well. A full sync then passes both.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.tiny_hf import TINY_QWEN3_MOE, read_safetensors_dir
from mpo.models.config import preset, to_hf_config
from mpo.rollout.client import EngineError
from mpo.rollout.local_engine import LocalEngineProcess
from mpo.rollout.pool import EngineHandle, RolloutPool
from mpo.rollout.protocol import GenerateRequest, SamplingParams
from mpo.bench._util import push_whole
from mpo.weight_sync.transports import WeightSync
from mpo.weight_sync.verify import (ProbeCoverage, covering_probes, run_probes, verify_by_probe, verify_checksum,
                                    weights_checksum)

CFG = preset("tiny")  # the engine's model: 4 layers, 8 experts, top-2, vocab 256
LOGPROB_TOL = 1e-5  # fp32 engine (SDPA, grouped expert matmuls) vs fp32 transformers (eager)
PROBE = [1 + (7 * i) % (CFG.vocab_size - 1) for i in range(16)]  # the trainer's 16-token probe (mpo.trainer.loop)
COVERAGE = ProbeCoverage(num_experts=CFG.num_experts, num_layers=CFG.num_layers, topk=CFG.router_topk,
                         vocab_size=CFG.vocab_size, tokens_per_sequence=32)


def _save_hf(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def _perturbed(model, seed: int, scale: float = 0.05):
    """The model moved as an optimizer step would (deterministic)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return model


def _load(directory: Path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager").eval()


def hf_forward(model, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log p(token t | tokens < t) for t >= 1 ([n-1], float64) and its top-k routes of every input
    position ([n, layers, top_k]) from the router logits."""
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0].double(), dim=-1)
    scored = logprobs[:-1].gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
    routes = torch.stack([logits.reshape(len(sequence), -1).topk(CFG.router_topk, dim=-1).indices
                          for logits in out.router_logits], dim=1)
    return scored, routes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The initial random checkpoint and two perturbed steps, each saved by transformers (safetensors, fp32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("hf_reference")
    hf_config = {**to_hf_config(CFG), "initializer_range": TINY_QWEN3_MOE["initializer_range"]}
    config = Qwen3MoeConfig(**{k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(5)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    dirs = [_save_hf(model, root / "step0")]
    for step in (1, 2):
        dirs.append(_save_hf(_perturbed(model, seed=step), root / f"step{step}"))
    return dirs


@pytest.fixture(scope="module")
def engine(tmp_path_factory, checkpoints):
    process = LocalEngineProcess.mpo_engine(log_path=tmp_path_factory.mktemp("hf_ref_engine") / "engine.log",
                                            api_key="k", extra_args=["--enable-return-routed-experts"],
                                            num_layers=CFG.num_layers, topk=CFG.router_topk).start()
    process.client.call("/update_weights_from_disk", {"model_path": str(checkpoints[0]), "weight_version": "hf0"})
    yield process
    process.stop()


def _named(directory: Path) -> list[tuple[str, torch.Tensor]]:
    return sorted(read_safetensors_dir(directory).items())


def _assert_rollouts_match(engine, directory: Path, label: str) -> None:
    """Sampled rollouts of the engine vs transformers (loaded from `directory`) on the same tokens: output log-probs
    within LOGPROB_TOL, the same expert set for every (token, layer)."""
    requests = [GenerateRequest(tuple(PROBE[: 3 + 2 * i]), SamplingParams(max_new_tokens=8, sampling_seed=11 + i),
                                return_routed_experts=True) for i in range(3)]
    results = RolloutPool([EngineHandle(engine.client)]).generate(requests)
    reference = _load(directory)
    worst, agree, total = 0.0, 0, 0
    for result in results:
        sequence = result.prompt_ids + result.output_ids
        logprobs, routes = hf_forward(reference, sequence)
        n_prompt, n = len(result.prompt_ids), len(sequence)
        engine_lp = torch.tensor(result.output_logprobs, dtype=torch.float64)
        worst = max(worst, (engine_lp - logprobs[n_prompt - 1:]).abs().max().item())
        assert result.routed_experts.shape == (n - 1, CFG.num_layers, CFG.router_topk)
        engine_sets = torch.from_numpy(result.routed_experts).long().sort(-1).values
        agree += (engine_sets == routes[: n - 1].sort(-1).values).all(-1).sum().item()
        total += (n - 1) * CFG.num_layers
    print(f"\n[hf reference] {label}: engine vs transformers max |log-prob diff| {worst:.2e}; routes agree "
          f"{agree}/{total} (token, layer)", file=sys.stderr)
    assert worst <= LOGPROB_TOL, f"{label}: engine vs transformers log-prob diff {worst:.3g}"
    assert agree == total


def test_engine_matches_transformers(engine, checkpoints):
    """Rollout log-probs and routed experts of the engine equal transformers' forward of the same tokens."""
    version = engine.client.call("/server_info", method="GET")["weight_version"]
    assert version == "hf0"
    _assert_rollouts_match(engine, checkpoints[0], "initial weights")


def test_engine_matches_transformers_after_weight_sync(engine, checkpoints):
    """Perturbed weights pushed over WeightSync (tensor path, small buckets): the engine now equals transformers
    loaded with the new weights, and its checksum equals theirs."""
    named = _named(checkpoints[1])
    sync = WeightSync([engine.client], engine="mpo", transport="tensor", bucket_bytes=32 << 10)
    report = push_whole(sync, named, version=1)
    verify_checksum(sync.clients, weights_checksum(named))
    assert report.buckets > 1
    _assert_rollouts_match(engine, checkpoints[1], "after sync")


def test_probe_input_logprobs_and_routes_match_transformers(engine, checkpoints):
    """The probe path (input_token_logprobs with logprob_start_len=0, routed experts of every input position)."""
    _full_sync(engine, checkpoints[1], 1)
    reference = _load(checkpoints[1])
    run = run_probes(engine.client, [PROBE], num_layers=CFG.num_layers, topk=CFG.router_topk)[0]
    logprobs, routes = hf_forward(reference, PROBE)
    diff = (torch.tensor(run.logprobs, dtype=torch.float64) - logprobs).abs().max().item()
    assert diff <= LOGPROB_TOL, f"probe log-probs vs transformers differ by {diff:.3g}"
    assert np.array_equal(np.sort(run.routes, -1), routes[: len(PROBE) - 1].sort(-1).values.numpy())


def _full_sync(engine, directory: Path, version: int) -> list[tuple[str, torch.Tensor]]:
    named = _named(directory)
    sync = WeightSync([engine.client], engine="mpo")
    push_whole(sync, named, version=version)
    verify_checksum(sync.clients, weights_checksum(named))
    return named


def _expert_missed_by(probe: list[int], routes: torch.Tensor) -> tuple[int, int]:
    """(layer, expert) of the last layer that no input position of `probe` before the last one is routed to."""
    layer = CFG.num_layers - 1
    used = set(routes[: len(probe) - 1, layer].flatten().tolist())
    return layer, min(set(range(CFG.num_experts)) - used)


def test_stale_expert_fails_verification(engine, checkpoints):
    """A sync that skips one expert (of one layer) must fail both verifications of mpo's engine: the checksum and
    the covering probe. The skipped expert is one a short probe never routes to, so that probe passes (what a
    probe that ignores coverage would have accepted); the probe built from the engine's routes covers it."""
    short = PROBE[:4]  # 3 scored positions x top-2 = 6 picks < 8 experts: some expert of every layer is missed
    _full_sync(engine, checkpoints[1], 1)
    reference = _load(checkpoints[2])
    layer, expert = _expert_missed_by(short, hf_forward(reference, short)[1])
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    named = _named(checkpoints[2])
    stale = [(name, t) for name, t in named if not name.startswith(prefix)]
    assert len(named) - len(stale) == 3, f"expected gate/up/down of {prefix}*"

    sync = WeightSync([engine.client], engine="mpo")
    push_whole(sync, stale, version=3)
    with pytest.raises(EngineError, match="weights differ from the trainer's"):
        verify_checksum(sync.clients, weights_checksum(named))
    # The short probe misses the stale expert: its log-probs still equal transformers' with the new weights.
    short_diff = verify_by_probe(sync.clients, [short], [[0.0] + hf_forward(reference, short)[0].tolist()])
    probes = covering_probes(engine.client, [PROBE], COVERAGE)
    runs = run_probes(engine.client, probes, num_layers=CFG.num_layers, topk=CFG.router_topk)
    hits = sum(int((run.routes[:, layer] == expert).sum()) for run in runs)
    assert hits >= 1, "the covering probe does not route to the stale expert"
    trainer = [[0.0] + hf_forward(reference, p)[0].tolist() for p in probes]
    with pytest.raises(EngineError, match=r"probe log-probs differ .* after weight sync") as caught:
        verify_by_probe(sync.clients, probes, trainer)
    print(f"\n[hf reference] stale layer {layer} expert {expert}: short probe diff {short_diff:.1e} (passes); "
          f"covering probe of {len(probes)} sequences / {sum(map(len, probes))} tokens routes {hits} tokens to it: "
          f"{caught.value}", file=sys.stderr)

    _full_sync(engine, checkpoints[2], 2)
    assert verify_by_probe(sync.clients, probes, trainer) <= LOGPROB_TOL


def test_covering_probe_reaches_every_expert_or_says_why(engine):
    """The probe grows until every (layer, expert) is routed to; a bound too small gives one clear error."""
    probes = covering_probes(engine.client, [PROBE], COVERAGE)
    runs = run_probes(engine.client, probes, num_layers=CFG.num_layers, topk=CFG.router_topk)
    for layer in range(CFG.num_layers):
        used = set(np.concatenate([run.routes[:, layer].ravel() for run in runs]).tolist())
        assert used == set(range(CFG.num_experts)), f"layer {layer}: experts {sorted(used)}"
    assert covering_probes(engine.client, [PROBE], COVERAGE) == probes, "the probe is not deterministic"
    with pytest.raises(EngineError, match=r"probe of 1 sequences \(3 tokens\) leaves \d+ \(layer, expert\) pairs "
                                          r"never routed to \(layer 0 expert \d+.*raise ProbeCoverage.max_sequences"):
        covering_probes(engine.client, [PROBE[:3]], dataclasses.replace(COVERAGE, max_sequences=1))
