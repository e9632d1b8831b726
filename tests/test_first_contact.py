"""First contact at target scale (issue #45, items 2, 3, 4 and 6): waits sized to the work, a probe that cannot kill a
healthy bf16 run, layouts no transport can sync refused up front, and SGLang request fields and timeouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSPO = "mpo/recipes/qwen3_30b_a3b_gspo.yaml"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)


# -- item 4: colocated layouts across nodes ----------------------------------------------------------------------

COLOCATED_TWO_NODES = ["rollout.colocate=true", "schedule.mode=sync", "sync.transport=distributed"]  # world 16


@pytest.mark.parametrize("argv", [
    ("-m", "mpo.cli", "check-config", "--config", GSPO, *COLOCATED_TWO_NODES),
    ("-m", "mpo.cli", "plan", "--config", GSPO, *COLOCATED_TWO_NODES),
    ("-m", "launch", "--config", GSPO, "--hosts", "g1,g2", "--gpus-per-node", "8", "--dry-run",
     *COLOCATED_TWO_NODES),
], ids=["check-config", "plan", "launch-dry-run"])
def test_first_contact_colocated_multi_node_layout_is_refused_in_one_line(argv):
    """Qwen3-30B-A3B's 16 trainer ranks on two 8-GPU nodes with SGLang colocated: 'distributed' would hold each GPU
    twice in NCCL; the run must not start (it used to fail after full start-up). The same-host transports reach
    every node's engines from that node (tests/test_colocated_multinode.py)."""
    out = _cli(*argv)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "NCCL cannot hold one device twice" in lines[0], out.stderr


def test_first_contact_launch_refuses_engines_placed_on_trainer_gpus_of_two_nodes():
    """No node left for rollout (2 nodes, 16 ranks): the launcher colocates the engines on the trainer's nodes even
    with rollout.colocate=false; 'distributed' would share a GPU in NCCL (the same-host ones route per node)."""
    from launch.plan import Allocation, LaunchOptions, PlanError, make_plan
    from mpo.config_checks import load_config

    for transport, message in (("distributed", "NCCL cannot hold one device twice"),):
        overrides = [f"sync.transport={transport}", "rollout.num_engines=2", "rollout.tensor_parallel=4"]
        config = load_config(str(REPO / GSPO), overrides)
        with pytest.raises(PlanError, match=message):
            make_plan(config, Allocation(hosts=("g1", "g2"), gpus_per_node=8, job_id="1"),
                      LaunchOptions(config_path=str(REPO / GSPO), overrides=tuple(overrides)))


# -- item 2: waits sized to the work -----------------------------------------------------------------------------

TIMEOUT_S = 3.0  # parallel.distributed_timeout_s of these runs: a rollout takes longer


def _rollout_wait_worker(out: str, scenario: str) -> None:
    """2 gloo ranks brought up as `mpo train` does (initialize_parallel) with a 3 s timeout. Rank 0 'generates' (sleeps:
    the engine's time, faked) longer than the timeout; rank 1 waits for its share (mpo.trainer.distribute)."""
    import json
    import os
    import time

    from mpo.parallel import ParallelConfig
    from mpo.parallel.init import initialize_parallel
    from mpo.trainer.distribute import Distributor
    from mpo.trainer.rows import Sample

    ctx = initialize_parallel(ParallelConfig(distributed_timeout_s=TIMEOUT_S), force_cpu=True)
    distributor = Distributor(ctx.object_group, dp_rank=ctx.rank, layers=(1,), num_layers=1)
    distributor.on_republish = lambda: None
    samples = [Sample(ids=[1, 2, 3, 4], prompt_len=2, group=0, reward=1.0)]
    if ctx.rank == 0:
        if scenario == "slow":
            time.sleep(2.5 * TIMEOUT_S)  # a rollout longer than the timeout
            distributor.republish()  # sync mode's stale engines: a second wait inside the same step
            time.sleep(1.5 * TIMEOUT_S)
            distributor(samples, updates=1, dp_size=2, packed=False)
        elif scenario == "hung":  # rank 0 alive but its heartbeat gone (stopped): a hang the others must not share
            distributor.close()
            time.sleep(4 * TIMEOUT_S)
        else:  # died: the process is gone, with the job's store it hosts (exit status 0: spawn_ranks would kill
            time.sleep(1.0)  # rank 1 on another one, before it could tell)
            os._exit(0)
        return
    started = time.monotonic()
    try:
        got = distributor(None, updates=1, dp_size=2, packed=False)
        result = {"ok": True, "lengths": [len(s.ids) for s in got]}
    except RuntimeError as exc:
        result = {"ok": False, "error": str(exc)}
    result["waited_s"] = time.monotonic() - started
    with open(out, "w") as f:
        json.dump(result, f)


def test_first_contact_ranks_wait_for_a_rollout_longer_than_the_timeout(tmp_path):
    """A rollout step of 4x distributed_timeout_s (with a re-publish inside it): rank 1 gets its samples. Before
    issue #45 its gloo receive timed out after 3 s."""
    import json

    from helpers.spawn import spawn_ranks

    out = tmp_path / "rank1.json"
    spawn_ranks(2, _rollout_wait_worker, str(out), "slow")
    result = json.loads(out.read_text())
    assert result["ok"], result
    assert result["lengths"] == [4] and result["waited_s"] > 3 * TIMEOUT_S


def test_first_contact_a_dead_or_hung_rank_0_is_still_detected_in_the_timeout(tmp_path):
    """No heartbeat for distributed_timeout_s (rank 0 hangs) or no rank 0 at all (it died): rank 1 stops waiting
    within the timeout (plus a poll) and says why in one line."""
    import json

    from helpers.spawn import spawn_ranks

    out = tmp_path / "hung.json"
    spawn_ranks(2, _rollout_wait_worker, str(out), "hung")
    hung = json.loads(out.read_text())
    assert not hung["ok"] and "rank 0 sent no heartbeat" in hung["error"] and "\n" not in hung["error"]
    assert TIMEOUT_S <= hung["waited_s"] < TIMEOUT_S + 2.0, hung

    out = tmp_path / "died.json"
    spawn_ranks(2, _rollout_wait_worker, str(out), "died")
    died = json.loads(out.read_text())
    assert not died["ok"] and "rank 0" in died["error"] and "\n" not in died["error"]
    assert died["waited_s"] < TIMEOUT_S + 2.0, died


# -- item 3: a probe that cannot kill a healthy bf16 run -------------------------------------------------------------

def _tiny_hf_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers.tiny_hf import TINY_QWEN3_MOE
    from mpo.models.config import preset, to_hf_config

    cfg = preset("tiny")  # 4 layers, 8 experts, top-2, vocab 256: the engine's model
    hf = {**to_hf_config(cfg), "initializer_range": TINY_QWEN3_MOE["initializer_range"]}
    config = Qwen3MoeConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    import torch

    torch.manual_seed(5)
    return cfg, Qwen3MoeForCausalLM(config).to(torch.float32).eval()


def test_first_contact_bf16_probe_passes_a_healthy_run_and_fails_a_wrong_expert(tmp_path):
    """mpo's engine (a real server, fp32) serves a tiny Qwen3-MoE; the 'trainer' scores the same probe with the same
    weights in bf16 and its own (natural) routing: transformers' forward, standing in for megatron's bf16 (no bf16
    megatron path runs on this CPU). Its largest log-prob difference is past 0.1, which aborted the run before issue
    #45; its median is ~1e-2. The check passes it and records what it measured; one expert of the last layer pushed
    wrong (x2) to the engine fails, naming that expert."""
    import torch

    from helpers.tiny_hf import read_safetensors_dir
    from mpo.bench._util import push_whole
    from mpo.rollout.client import EngineError
    from mpo.rollout.local_engine import LocalEngineProcess
    from mpo.weight_sync.transports import WeightSync
    from mpo.weight_sync.verify import check_probe, probe_bounds, verify_by_probe

    cfg, model = _tiny_hf_model()
    model.save_pretrained(tmp_path / "hf")
    generator = torch.Generator().manual_seed(0)
    probes = torch.randint(1, cfg.vocab_size, (16, 64), generator=generator).tolist()
    with torch.no_grad():
        bf16 = model.to(torch.bfloat16)(torch.tensor(probes)).logits.double().log_softmax(-1)
    scored = bf16[:, :-1].gather(-1, torch.tensor(probes)[:, 1:, None])[..., 0]
    trainer = [[0.0, *row.tolist()] for row in scored]

    engine = LocalEngineProcess.mpo_engine(log_path=tmp_path / "engine.log", api_key="k",
                                           extra_args=["--enable-return-routed-experts"], num_layers=cfg.num_layers,
                                           topk=cfg.router_topk).start()
    try:
        engine.client.call("/update_weights_from_disk", {"model_path": str(tmp_path / "hf"), "weight_version": "0"})
        shape = dict(num_layers=cfg.num_layers, topk=cfg.router_topk, num_experts=cfg.num_experts)
        with pytest.raises(EngineError, match="differ"):  # the old rule: every token within 0.1
            verify_by_probe([engine.client], probes, trainer, tolerance=0.1)
        metrics = check_probe([engine.client], probes, trainer, probe_bounds("bf16"), **shape)
        assert metrics["sync_probe_logprob_maxdiff"] > 0.1 and metrics["sync_probe_logprob_median"] < 0.02, metrics
        assert 0 < metrics["sync_probe_logprob_worst_group_median"] < 0.04, metrics

        layer, expert = cfg.num_layers - 1, 5
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        wrong = [(name, 2 * t) for name, t in sorted(read_safetensors_dir(tmp_path / "hf").items())
                 if name.startswith(prefix)]
        assert len(wrong) == 3
        push_whole(WeightSync([engine.client], engine="mpo"), wrong, version=1)
        with pytest.raises(EngineError, match=f"routed to layer {layer} expert {expert} .*a wrong expert tensor"):
            check_probe([engine.client], probes, trainer, probe_bounds("bf16"), **shape)
    finally:
        engine.stop()


# -- item 6: prompt routes once per sample, timeouts from the token budget, the covering probe's cap ----------------

def test_first_contact_prompt_routes_once_timeouts_and_probe_cap(tmp_path, caplog):
    """mpo's engine (a real server) takes SGLang 0.5.23's routed_experts_start_len; a client asking for a prompt's
    routes once (as it does for SGLang) gets every sample's full routes back, the prompt's rows from the prompt's
    first sample. A call's timeout grows with its token budget. A probe that cannot cover every expert within
    sync.probe_max_sequences warns and verifies what it covers (it ended the run before)."""
    import asyncio
    import logging

    import numpy as np

    from mpo.config_checks import load_config
    from mpo.models.config import preset
    from mpo.rollout.client import EngineClient
    from mpo.rollout.local_engine import LocalEngineProcess
    from mpo.rollout.protocol import GenerateRequest, SamplingParams, call_timeout_s
    from mpo.weight_sync.verify import ProbeCoverage, covering_probe_runs

    cfg = preset("tiny")
    engine = LocalEngineProcess.mpo_engine(log_path=tmp_path / "engine.log", api_key="k",
                                           extra_args=["--enable-return-routed-experts"], num_layers=cfg.num_layers,
                                           topk=cfg.router_topk).start()
    try:
        prompt = [5, 6, 7, 8]
        body = {"input_ids": [prompt, prompt[:3]], "return_routed_experts": True, "routed_experts_start_len": 3,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        answers = engine.client.call("/generate", body)
        from mpo.rollout.protocol import decode_routed_experts

        for ids, answer in zip(body["input_ids"], answers):
            rows = len(ids) + len(answer["output_ids"]) - 1 - 3
            assert decode_routed_experts(answer["meta_info"]["routed_experts"], rows=rows, num_layers=cfg.num_layers,
                                         topk=cfg.router_topk).shape[0] == rows

        client = EngineClient(engine.client.url, api_key="k", num_layers=cfg.num_layers, topk=cfg.router_topk,
                              num_experts=cfg.num_experts, prompt_routes_once=True)
        requests = [GenerateRequest(tuple(p), SamplingParams(max_new_tokens=5, sampling_seed=s),
                                    return_routed_experts=True)
                    for p, s in ((prompt, 1), (prompt, 2), ([9, 10, 11], 3), (prompt, 4), ([9, 10, 11], 5))]
        results = asyncio.run(client.generate_batch(requests))
        for request, result in zip(requests, results):
            n = len(request.input_ids) + len(result.output_ids)
            assert result.routed_experts.shape == (n - 1, cfg.num_layers, cfg.router_topk)
        for i, j in ((1, 0), (3, 0), (4, 2)):  # a later sample carries its prompt's rows from the first sample
            rows = len(requests[i].input_ids)
            assert np.array_equal(results[i].routed_experts[:rows], results[j].routed_experts[:rows])

        big = [GenerateRequest((1,), SamplingParams(max_new_tokens=32768))] * 16
        assert call_timeout_s(big, 1800.0) >= 1800.0 + 16 * 32768 / 100  # 16 x 32k at <= 100 tokens/s still fits
        assert call_timeout_s(big[:1], 300.0) < 1000.0  # a small call keeps its hung-engine bound near the base

        coverage = ProbeCoverage(num_experts=cfg.num_experts, num_layers=cfg.num_layers, topk=cfg.router_topk,
                                 vocab_size=cfg.vocab_size, max_sequences=1, strict=False)
        with caplog.at_level(logging.WARNING, logger="mpo.weight_sync.verify"):
            probes, runs, uncovered = covering_probe_runs(engine.client, [prompt[:3]], coverage)
        assert probes == [prompt[:3]] and len(runs) == 1 and uncovered > 0
        assert "raise sync.probe_max_sequences (now 1)" in caplog.text
        config = load_config(str(REPO / "mpo/recipes/demo_cpu.yaml"), ["sync.probe_max_sequences=8"])
        assert config.sync.probe_max_sequences == 8
    finally:
        engine.stop()
