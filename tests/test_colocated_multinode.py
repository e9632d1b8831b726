"""Colocated multi-node weight sync (issue #50 item 4): each node's engines get every bucket from a trainer rank of
their own node (mpo.weight_sync.relay), over a same-host transport.

- test_colocated_relay_routes_every_bucket_to_every_node: three real gloo ranks, two "nodes" told apart by
  MPO_NODE_HOST (as the launcher sets it), two senders on different nodes; the engines are stand-ins (a push records
  what it was given), everything else (routes, packing, the relay group's sends, the leader's shared-memory receive
  buffer) is the real code.
- test_colocated_two_node_shm_sync_under_slurm: the SLURM tier's local cluster, `sbatch` two nodes, a trainer rank
  and one mpo engine on each, rollout.colocate=true, sync.transport=shm: the run trains, node 1's leader relays
  every bucket of rank 0 to its node's engine, and rank 0's checksum verifies both engines every step.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time

import pytest

from helpers.spawn import spawn_ranks

URLS = ["http://nA:1", "http://nB:2", "http://nB:3"]
NODE_OF_RANK = ["nA", "nB", "nB"]
BUCKETS = {0: 3, 2: 2}  # sender rank -> buckets (stage 0's sender on nA, stage 1's on nB)


def _bucket(sender: int, k: int):
    import torch

    g = torch.Generator().manual_seed(100 * sender + k)
    return [(f"s{sender}.b{k}.w", torch.randn(5, 7, generator=g)),
            (f"s{sender}.b{k}.h", torch.randn(3, generator=g).to(torch.bfloat16)),
            (f"s{sender}.b{k}.q", torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn))]


def _digest(bucket) -> list[tuple[str, str]]:
    import torch

    return sorted((name, hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                   + str(t.dtype) + str(tuple(t.shape))) for name, t in bucket)


def relay_worker(out: str) -> None:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["MPO_NODE_HOST"] = NODE_OF_RANK[rank]
    from mpo.weight_sync.relay import NodeRelay, engines_on_this_node, plan_routes, relay_group

    claims: list = [None] * 3
    dist.all_gather_object(claims, engines_on_this_node(URLS))
    routes = plan_routes(claims, sorted(BUCKETS), len(URLS))
    got: list[tuple[int, str, list]] = []  # (engine, how, digest)

    def to_engines(how):
        def push(bucket):
            for i in claims[rank]:
                got.append((i, how, _digest(bucket)))
        return push

    relay = NodeRelay(routes, rank=rank, buckets_of=BUCKETS, group=relay_group(60.0, "gloo"),
                      device=__import__("torch").device("cpu"),
                      direct=to_engines("direct") if rank in BUCKETS else None,
                      leader_push=to_engines("relayed") if rank in routes.node_of_engine else None, shared=True)
    for k in range(BUCKETS.get(rank, 0)):
        relay.push(_bucket(rank, k))
    relay.finish(60.0)
    everything: list = [None] * 3
    dist.all_gather_object(everything, (got, relay.relayed, claims, routes.node_of_engine))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everything, f)
    dist.destroy_process_group()


def test_colocated_relay_routes_every_bucket_to_every_node(tmp_path):
    out = tmp_path / "got.json"
    spawn_ranks(3, relay_worker, str(out))
    everything = json.loads(out.read_text())
    claims, leaders = everything[0][2], everything[0][3]
    assert claims == [[0], [1, 2], [1, 2]] and leaders == [0, 1, 1]  # one leader per node, its lowest rank
    expected = sorted(json.dumps(_digest(_bucket(s, k))) for s, n in BUCKETS.items() for k in range(n))
    per_engine: dict[int, list] = {i: [] for i in range(len(URLS))}
    for got, _, _, _ in everything:
        for engine, how, digest in got:
            per_engine[engine].append((how, json.dumps(digest)))
    for engine, pushes in per_engine.items():  # every engine got every bucket exactly once, bit for bit
        assert sorted(d for _, d in pushes) == expected, engine
    # nA's engine: sender 0's buckets directly, sender 2's relayed by rank 0; nB's: the reverse, relayed by rank 1
    assert sorted(how for how, _ in per_engine[0]) == ["direct"] * 3 + ["relayed"] * 2
    assert sorted(how for how, _ in per_engine[1]) == ["direct"] * 2 + ["relayed"] * 3
    assert [e[1] for e in everything] == [2, 3, 0]  # buckets each leader received and pushed


def test_colocated_plan_lifts_refusal_for_same_host_transports(monkeypatch):
    """`launch --dry-run` plans what it used to refuse (shm to mpo engines on both trainer nodes; cuda_ipc / tensor
    to SGLang colocated on two GPU nodes), tells each trainer node its host, and still refuses 'distributed'."""
    from pathlib import Path

    from launch.plan import Allocation, LaunchOptions, PlanError, make_plan
    from mpo.config_checks import load_config

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    demo = "mpo/recipes/demo_cpu.yaml"
    overrides = ["world_size=2", "parallel.expert_parallel=2", "rollout.num_engines=2", "rollout.colocate=true",
                 "sync.transport=shm"]
    plan = make_plan(load_config(demo, overrides), Allocation(hosts=("n1", "n2"), gpus_per_node=0, job_id="7"),
                     LaunchOptions(config_path=demo, overrides=tuple(overrides)))
    assert plan.placement == "colocated" and sorted(plan.engine_urls)[0].startswith("http://n1:")
    assert [p.env.get("MPO_NODE_HOST") for n in plan.nodes for p in n.processes if p.kind == "trainer"] == ["n1", "n2"]
    gspo = "mpo/recipes/qwen3_30b_a3b_gspo.yaml"
    for transport in ("tensor", "cuda_ipc"):
        over = [f"sync.transport={transport}", "rollout.num_engines=2", "rollout.tensor_parallel=4",
                "model.random_init=true"]
        plan = make_plan(load_config(gspo, over), Allocation(hosts=("g1", "g2"), gpus_per_node=8, job_id="7"),
                         LaunchOptions(config_path=gspo, overrides=tuple(over)))
        assert plan.placement == "colocated" and len(plan.engine_urls) == 2
    over = ["sync.transport=distributed", "rollout.num_engines=2", "rollout.tensor_parallel=4", "model.random_init=true"]
    with pytest.raises(PlanError, match="NCCL cannot hold one device twice"):
        make_plan(load_config(gspo, over), Allocation(hosts=("g1", "g2"), gpus_per_node=8, job_id="7"),
                  LaunchOptions(config_path=gspo, overrides=tuple(over)))


# -- the SLURM tier --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest):
    from helpers.slurm_cluster import cluster_fixture

    yield from cluster_fixture(request)


def test_colocated_two_node_shm_sync_under_slurm(cluster, tmp_path):
    from helpers.slurm_cluster import assert_nothing_left, submit, wait

    out_dir, out_file = tmp_path / "run", tmp_path / "job.out"
    t0 = time.monotonic()
    proc, job_id, name = submit(cluster, out_file, f"schedule.steps=3 schedule.sft_steps=2 logging.out_dir={out_dir} "
                                                    "logging.progress=false logging.tensorboard=false "
                                                    "rollout.colocate=true rollout.num_engines=2 sync.transport=shm")
    code = wait(proc, name, cluster)
    output = out_file.read_text() if out_file.exists() else ""
    print(f"\n[slurm] colocated 2-node shm job {job_id}: exit {code} in {time.monotonic() - t0:.1f} s",
          file=sys.stderr)
    assert code == 0, output
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # it trained
    run_dir = out_dir / "launch" / f"{job_id}.0"
    assert (run_dir / "node0-n1" / "engine1.log").exists() and (run_dir / "node1-n2" / "engine0.log").exists()
    for row in rows:  # every sync: two nodes with engines, node n2's leader (rank 1) pushed every bucket of rank 0,
        # rank 0's checksum verified both engines (a mismatch fails the step) and each engine says it runs the version
        assert row["sync_engine_nodes"] == 2.0, row
        assert row["sync_relayed_buckets"] == row["sync_buckets"] > 0, row
        assert row["sync_engines_at_version"] == 2.0, row
    assert_nothing_left(job_id, [int(p) for p in re.findall(r"\(pid (\d+)\)", output)])
