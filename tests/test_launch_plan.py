"""The launcher's plan (launch/plan.py) and `python -m launch --dry-run`: placement, exact commands, errors.

Nothing is faked: the plan is a pure function of the config and the allocation, so these tests compute it for
allocations this machine does not have (4 nodes x 8 GPUs) without starting anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.plan import Allocation, LaunchOptions, PlanError, derived_ports, make_plan
from mpo.config_checks import load_config, model_config

REPO = Path(__file__).resolve().parents[1]
GSPO = "mpo/recipes/qwen3_30b_a3b_gspo.yaml"
DEMO = "mpo/recipes/demo_cpu.yaml"
TWO_RANKS = ["world_size=2", "parallel.expert_parallel=2"]  # the demo at EP2, a rank per node (the demo runs one)

# The 4-node GPU example: 2 trainer nodes x 8 GPUs (EP8), 2 rollout nodes with 2 SGLang engines of TP4 each.
RUN = "runs/qwen3_30b_a3b_gspo/launch/1234"
TRAINER = ("PY -m torch.distributed.run --nnodes 2 --node-rank {k} --nproc-per-node 8 --master-addr gpu1 "
           "--master-port 29400 --max-restarts 0 --log-dir " + RUN + "/node{k}-gpu{n}/ranks --redirects 3 --tee 3 "
           "-m mpo.trainer --config " + RUN + "/config.yaml")
# With a key SGLang starts through a `python -c LAUNCHER` that adds the key from MPO_API_KEY (never argv); the
# launcher's own text is checked by running it (test_sglang_key_launcher_hardening_keeps_key_off_argv).
ENGINE = ("SGPY -c LAUNCHER --model-path mpo/recipes/hf_configs/qwen3_30b_a3b --tp 4 --host gpu{n} "
          "--port {port} --dtype bfloat16 --enable-return-routed-experts --enable-fp32-lm-head")
KEY_ENV = {"MPO_API_KEY": "KEY"}
TRAINER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
EXPECTED_GPU_PLAN = [
    ("gpu1", "trainer", [("trainer", TRAINER.format(k=0, n=1), TRAINER_ENV)]),
    ("gpu2", "trainer", [("trainer", TRAINER.format(k=1, n=2), TRAINER_ENV)]),
    ("gpu3", "rollout", [("engine0", ENGINE.format(n=3, port=30000), {"CUDA_VISIBLE_DEVICES": "0,1,2,3", **KEY_ENV}),
                         ("engine1", ENGINE.format(n=3, port=30001), {"CUDA_VISIBLE_DEVICES": "4,5,6,7", **KEY_ENV})]),
    ("gpu4", "rollout", [("engine2", ENGINE.format(n=4, port=30002), {"CUDA_VISIBLE_DEVICES": "0,1,2,3", **KEY_ENV}),
                         ("engine3", ENGINE.format(n=4, port=30003), {"CUDA_VISIBLE_DEVICES": "4,5,6,7", **KEY_ENV})]),
]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name paths relative to the repo root


def _plan(path, overrides=(), hosts=("gpu1", "gpu2", "gpu3", "gpu4"), gpus=8, **options):
    config = load_config(path, list(overrides))
    defaults = dict(config_path=path, overrides=tuple(overrides), python="PY", engine_python="SGPY",
                    master_port=29400, engine_port=30000)
    return make_plan(config, Allocation(hosts=hosts, gpus_per_node=gpus, job_id="1234"),
                     LaunchOptions(**{**defaults, **options}))


def _command(process) -> str:
    """The command line, with SGLang's key launcher (`-c <code>`) shown as `-c LAUNCHER`."""
    argv = list(process.argv)
    if argv[1] == "-c":
        argv[2] = "LAUNCHER"
    return " ".join(argv)


def test_four_node_gpu_plan_matches_expected():
    plan = _plan(GSPO, ["rollout.api_key=KEY"])
    got = [(n.host, n.role, [(p.name, _command(p), {k: v for k, v in p.env.items() if k != "PYTHONUNBUFFERED"}
                               if p.kind == "engine" else p.env) for p in n.processes]) for n in plan.nodes]
    assert got == EXPECTED_GPU_PLAN
    assert plan.placement == "disaggregated"
    urls = ["http://gpu3:30000", "http://gpu3:30001", "http://gpu4:30002", "http://gpu4:30003"]
    assert list(plan.engine_urls) == urls
    assert plan.trainer_overrides == (f"rollout.urls=[{','.join(urls)}]", "sync.master_address=gpu1")
    import yaml

    data = yaml.safe_load(plan.resolved_config)  # what every trainer rank reads: the config plus the engine URLs
    assert data["rollout"]["urls"] == urls and data["rollout"]["api_key"] == "KEY"


def test_dry_run_prints_exact_commands_per_node():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_JOB_NODELIST", None)
    out = subprocess.run([sys.executable, "-m", "launch", "--config", GSPO, "--hosts", "gpu1,gpu2,gpu3,gpu4",
                          "--gpus-per-node", "8", "--job-id", "1234", "--python", "PY", "--engine-python", "SGPY",
                          "--master-port", "29400", "--engine-port", "30000", "--dry-run", "rollout.api_key=KEY",
                          "model.random_init=true"],  # the recipe's hf_dir holds a config.json, no weights
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    expected = ["placement: disaggregated; engines: http://gpu3:30000, http://gpu3:30001, http://gpu4:30002, "
                "http://gpu4:30003", f"resolved config: {RUN}/config.yaml",
                "weight-update group: master gpu1, world size 17, engine rank offsets 1, 5, 9, 13"]
    for k, (host, role, procs) in enumerate(EXPECTED_GPU_PLAN):
        expected.append(f"node {k} ({host}): {role}")
        for name, command, penv in procs:
            full_env = {**penv, "PYTHONUNBUFFERED": "1", **({"MPO_API_KEY": "<redacted>"} if "MPO_API_KEY" in penv
                                                            else {})}
            prefix = " ".join(f"{key}={value}" for key, value in sorted(full_env.items()))
            expected.append(f"  [{name}] {prefix} {command}")
            expected.append(f"      log: {RUN}/node{k}-{host}/{name}.log")
    # The key never appears (the engine gets it in its environment), and SGLang's launcher is one quoted argument.
    assert "KEY" not in out.stdout.replace("MPO_API_KEY", "")
    shown = [re.sub(r"-c '[^']*'", "-c LAUNCHER", line) for line in lines]
    assert shown == expected


def test_cpu_demo_on_two_nodes_is_colocated_with_engine_on_last_node():
    plan = _plan(DEMO, [*TWO_RANKS, "logging.out_dir=/tmp/r"], hosts=("n1", "n2"), gpus=0)
    assert plan.placement == "colocated"
    assert [n.role for n in plan.nodes] == ["trainer", "trainer+rollout"]
    trainer = plan.nodes[1].processes[0]
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr n1" in " ".join(trainer.argv)
    assert trainer.env["OMP_NUM_THREADS"] == "1"
    engine = plan.nodes[1].processes[1]
    assert engine.argv[:3] == ("SGPY", "-m", "mpo.engine") and engine.url == "http://n2:30000"
    assert "--enable-return-routed-experts" in engine.argv and "--fp32-lm-head" in engine.argv


def test_cpu_disaggregated_and_external_engines():
    plan = _plan(DEMO, ["world_size=2"], hosts=("n1", "n2"), gpus=0, trainer_nodes=1)
    assert [n.role for n in plan.nodes] == ["trainer", "rollout"]
    assert "--nproc-per-node 2" in " ".join(plan.nodes[0].processes[0].argv)
    ext = _plan(DEMO, [*TWO_RANKS, "rollout.urls=[http://e:1]"], hosts=("n1", "n2"), gpus=0)
    assert ext.placement == "external" and ext.trainer_overrides == ()
    assert all(p.kind == "trainer" for n in ext.nodes for p in n.processes)


def test_ports_derive_from_job_id_and_agree():
    config = load_config(DEMO, TWO_RANKS)
    a = make_plan(config, Allocation(("n1", "n2"), 0, "77.0"), LaunchOptions(config_path=DEMO))
    b = make_plan(config, Allocation(("n1", "n2"), 0, "77.0"), LaunchOptions(config_path=DEMO))
    c = make_plan(config, Allocation(("n1", "n2"), 0, "78.0"), LaunchOptions(config_path=DEMO))
    assert a == b and a.engine_urls != c.engine_urls


def test_derived_ports_stay_below_the_ephemeral_range():
    """A derived port in Linux's default ephemeral range (32768-60999) can be handed to any outgoing connection on
    the node before the engine binds it: CI lost a job so (job id 15.0: engine port 44872, "Address already in use"; the
    old derivation put 83% of job ids' engine ports in the range). Every job id's master and engine ports, with 64
    engines, stay below it, and the engines' ranges do not reach the masters'."""
    seen = set()
    for job in [str(n) for n in range(20000)] + [f"{n}.0" for n in range(2000)]:
        master, engine = derived_ports(job)
        assert 20000 <= master < 22000 and 22000 <= engine and engine + 64 <= 32768, (job, master, engine)
        seen.add(engine)
    assert len(seen) > 1000  # spread: two jobs sharing a node rarely meet
    config = load_config(DEMO, TWO_RANKS)
    plan = make_plan(config, Allocation(("n1", "n2"), 0, "15.0"), LaunchOptions(config_path=DEMO))
    ports = [int(url.rsplit(":", 1)[1]) for url in plan.engine_urls]
    assert ports == [derived_ports("15.0")[1] + i for i in range(len(ports))] and max(ports) < 32768, ports


@pytest.mark.parametrize("overrides, hosts, gpus, message", [
    (["rollout.num_engines=5"], 4, 8, "do not fit"),
    (["rollout.tensor_parallel=3"], 4, 8, "does not divide the 8 GPUs"),
    (["world_size=12", "parallel.expert_parallel=4"], 4, 8, "not a multiple of the 8 GPUs"),
    (["world_size=48"], 4, 8, "needs 6 nodes"),
    ([], 4, 0, "needs GPU nodes"),
    (["sync.transport=tensor"], 4, 8, "engine0 is placed on rollout node g2: set sync.transport='distributed'"),
])
def test_plan_errors_name_the_problem(overrides, hosts, gpus, message):
    with pytest.raises(PlanError, match=message):
        _plan(GSPO, overrides, hosts=tuple(f"g{i}" for i in range(hosts)), gpus=gpus)


def test_plan_states_the_weight_update_group_the_trainer_makes(tmp_path):
    """sync.transport=distributed with 4 SGLang engines of TP4 on gpu3/gpu4 and trainer rank 0 on gpu1: the group has
    1 + 16 ranks, each engine its own block of ranks, and a rendezvous the other nodes can route to. The trainer's
    EngineSet, built from the resolved config its ranks read, must make exactly that group."""
    from mpo.trainer.loop import engine_set
    from mpo.weight_sync.transports import engine_set_sync

    plan = _plan(GSPO, ["rollout.api_key=KEY"])
    group = plan.weight_sync
    assert group.world_size == 17 and group.tp_sizes == (4, 4, 4, 4)
    blocks = [set(range(offset, offset + tp)) for offset, tp in zip(group.rank_offsets, group.tp_sizes)]
    assert all(a.isdisjoint(b) for i, a in enumerate(blocks) for b in blocks[i + 1:])
    assert set().union(*blocks) == set(range(1, 17))  # rank 0 is the trainer's
    assert group.master_address == "gpu1"  # engines run on gpu3/gpu4: 127.0.0.1 would be their own node
    resolved = tmp_path / "config.yaml"
    resolved.write_text(plan.resolved_config)
    config = load_config(resolved)
    assert config.sync.transport == "distributed"
    # external URLs: nothing starts
    sync = engine_set_sync(engine_set(config, tmp_path), config.sync)
    assert sync.master_address == "gpu1" and sync.tp_sizes == [4, 4, 4, 4]
    # One local node: engines and trainer share it, loopback is right.
    local = _plan(DEMO, ["rollout.num_engines=2"], hosts=("127.0.0.1",), gpus=0)
    assert local.weight_sync.master_address == "127.0.0.1" and local.weight_sync.world_size == 3
    assert local.weight_sync.rank_offsets == (1, 2)


def test_engine_set_refuses_distributed_sync_with_loopback_master_and_remote_engines(tmp_path):
    from mpo.trainer.loop import engine_set
    from mpo.weight_sync.transports import engine_set_sync

    config = load_config(DEMO, ["rollout.urls=[http://engine-host:30000]", "sync.transport=distributed"])
    with pytest.raises(ValueError, match="sync.master_address"):
        engine_set_sync(engine_set(config, tmp_path), config.sync)


def _without_host_port(argv) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--host", "--port"):
            skip = True
        else:
            out.append(arg)
    return out


def test_engine_set_refuses_tensor_sync_to_sglang_on_another_node(tmp_path):
    from mpo.trainer.loop import engine_set
    from mpo.weight_sync.transports import engine_set_sync

    config = load_config(GSPO, ["rollout.urls=[http://engine-host:30000]", "sync.transport=tensor"])
    with pytest.raises(ValueError, match="engine http://engine-host:30000 is on another node: set sync.transport="):
        engine_set_sync(engine_set(config, tmp_path), config.sync)


def test_plan_and_engine_set_start_the_same_engine(tmp_path):
    """The launcher's engine and the trainer's local EngineSet engine for one config: same command up to host and
    port, same key in the environment. The settings that drifted before (engine_dtype, seed) are set; mcore_dir is
    the trainer's to load and publish."""
    import torch
    import torch.distributed.checkpoint as dcp

    from mpo.rollout.engines import EngineSet
    from mpo.trainer.loop import engine_settings

    # validation reads model.mcore_dir's metadata: a real (one-tensor) torch_dist checkpoint
    dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    overrides = ["rollout.api_key=KEY", "rollout.engine_dtype=bf16", "seed=7", f"model.mcore_dir={tmp_path}/ckpt"]
    plan = _plan(DEMO, overrides, hosts=("n1",), gpus=0, engine_python=sys.executable)
    planned = [p for p in plan.nodes[0].processes if p.kind == "engine"][0]
    demo = load_config(DEMO, overrides)
    local = EngineSet.local_processes(1, engine_settings(demo), tmp_path, model_config(demo))[0]
    assert _without_host_port(planned.argv) == _without_host_port(local.command)
    command = " ".join(planned.argv)
    assert "--dtype bf16" in command and "--seed 7" in command
    # a run's trainer publishes its weights (model.mcore_dir's, loaded by the trainer) before the first rollout: the
    # engine does not build or load its own (EngineSettings.await_weights)
    assert "--await-weights" in planned.argv and "--mcore-dir" not in planned.argv
    assert planned.env["MPO_API_KEY"] == local.env["MPO_API_KEY"] == "KEY"
    assert "KEY" not in planned.argv and "KEY" not in local.command


def test_sglang_key_launcher_hardening_keeps_key_off_argv(tmp_path):
    """SGLang's command with a key: the key reaches sglang.launch_server's sys.argv (as `--api-key K`) but not the
    process's real argv (/proc/self/cmdline, what `ps` shows). SGLang itself is faked by a module that records both
    (the real server with a key runs in tests/test_sglang_server.py when the SGLang tier is available)."""
    from mpo.rollout.engine_command import EngineSettings, engine_command

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    out = tmp_path / "out.json"
    (fake / "launch_server.py").write_text(
        "import json, sys\n"
        "if __name__ == '__main__':\n"
        "    cmdline = [a.decode() for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0')]\n"
        f"    json.dump({{'argv': sys.argv[1:], 'cmdline': cmdline}}, open({str(out)!r}, 'w'))\n")
    command = engine_command(EngineSettings(engine="sglang", hf_dir="/m", api_key="K3y-s3cret"), python=sys.executable,
                             host="h", port=5)
    env = {**os.environ, **command.env, "PYTHONPATH": str(tmp_path / "fake")}
    subprocess.run(command.argv, env=env, check=True, timeout=60)
    import json

    seen = json.loads(out.read_text())
    assert seen["argv"][-2:] == ["--api-key", "K3y-s3cret"]
    assert seen["argv"][:-2] == list(command.argv[3:])  # the rest reaches SGLang unchanged
    assert not any("K3y-s3cret" in arg for arg in seen["cmdline"])
    assert not any("K3y-s3cret" in arg for arg in command.argv)


def test_engine_set_stops_the_engines_it_started_when_a_later_one_fails_to_launch(tmp_path):
    """Two local engines; the second cannot open its log (a directory stands where the file goes): the constructor
    raises that error, and the first engine, already started, is stopped rather than left to its watchdog."""
    import psutil

    from mpo.trainer.loop import engine_set

    config = load_config(DEMO, ["rollout.num_engines=2"])
    (tmp_path / "logs" / "engine1.log").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        engine_set(config, tmp_path, wait=False)
    alive = [p for p in psutil.Process().children(recursive=True) if "mpo.engine" in " ".join(p.cmdline())]
    assert alive == []


def test_auto_sync_transport_is_shm_for_engines_a_cpu_run_starts_and_tensor_for_configured_urls(tmp_path):
    """sync.transport unset ("auto"): the demo's own engine (started by the run, on this CPU host) gets its buckets
    through shared memory, unless sync.host_shared_memory=false; engines the run is given as URLs (perhaps on another
    host) through the HTTP body."""
    from mpo.trainer.loop import engine_set
    from mpo.weight_sync.transports import engine_set_sync

    config = load_config(DEMO)
    assert config.sync.transport == "auto"
    given = load_config(DEMO, ["rollout.urls=[http://127.0.0.1:9]"])  # nothing listens there: asked, then configured
    assert engine_set_sync(engine_set(given, tmp_path), given.sync).transport == "tensor"
    started = engine_set(config, tmp_path)
    try:
        sync = engine_set_sync(started, config.sync)
        assert sync.transport == "shm"
    finally:
        started.stop()
    refused = load_config(DEMO, ["sync.host_shared_memory=false"])  # a tiny /dev/shm: auto keeps off it
    started = engine_set(refused, tmp_path / "refused")
    try:
        assert engine_set_sync(started, refused.sync).transport == "tensor"
    finally:
        started.stop()
