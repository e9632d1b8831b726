"""mpo's own engine behind SGLang's HTTP API (a real server process, real HTTP): its log-probs equal the trainer's
log-probs of the same tokens, its weights' checksum equals the trainer's, and the pool survives a killed or hung
engine with every sample arriving exactly once."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import engine_worker
from helpers.spawn import spawn_ranks
from mpo.rollout.client import EngineClient, EngineError
from mpo.parallel.ports import free_port
from mpo.rollout.local_engine import LocalEngineProcess
from mpo.rollout.pool import EngineHandle, PoolConfig, RolloutPool
from mpo.rollout.protocol import GenerateRequest, SamplingParams


def _requests(n: int, max_new_tokens: int = 6, routes: bool = False) -> list[GenerateRequest]:
    return [GenerateRequest(tuple(range(1 + i % 5, 6 + i % 5)), SamplingParams(max_new_tokens=max_new_tokens,
                                                                                sampling_seed=100 + i),
                            return_routed_experts=routes)
            for i in range(n)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    started = [LocalEngineProcess.mpo_engine(log_path=logs / f"engine{i}.log", api_key="k",
                                             extra_args=["--enable-return-routed-experts"]).start()
               for i in range(2)]
    yield started
    for engine in started:
        engine.stop()


def test_logprobs_routes_and_checksum_equal_the_trainer(engines, tmp_path):
    engines[0].client.num_layers, engines[0].client.topk = 4, 2  # the tiny preset
    results = RolloutPool([EngineHandle(engines[0].client)]).generate(_requests(4, routes=True))
    sequences = [r.prompt_ids + r.output_ids for r in results]
    out = tmp_path / "trainer.pt"
    spawn_ranks(1, engine_worker.score, str(out), sequences)
    trainer = torch.load(out, weights_only=True)
    worst = 0.0
    for result, trainer_logprobs in zip(results, trainer["logprobs"]):
        engine_lp = torch.tensor(result.output_logprobs)
        worst = max(worst, (engine_lp - trainer_logprobs[len(result.prompt_ids):]).abs().max().item())
    assert worst <= 1e-5, f"engine vs trainer log-prob diff {worst:.3g}"
    for result, trainer_routes in zip(results, trainer["routes"]):
        n = len(result.prompt_ids) + len(result.output_ids)
        assert result.routed_experts.shape == (n - 1, 4, 2)
        # Same expert sets per token and layer (order within top-k is not part of the contract).
        engine_sets = torch.from_numpy(result.routed_experts).sort(-1).values
        assert torch.equal(engine_sets, trainer_routes[: n - 1].sort(-1).values)
    assert engines[0].client.call("/weights_checksum", method="GET")["checksum"] == trainer["checksum"]


def test_killed_engine_is_restarted_and_every_sample_arrives_once(engines):
    requests = _requests(24, max_new_tokens=12)
    reference = RolloutPool([EngineHandle(engines[1].client)]).generate(requests)

    victim = engines[0]
    pool = RolloutPool([EngineHandle(victim.client, restart=victim.restart), EngineHandle(engines[1].client)],
                       PoolConfig(max_concurrency_per_engine=4, backoff_s=0.1))
    victim.client.pause_generation(mode="in_place")  # requests queue up there, so the kill lands mid-rollout
    killer = threading.Timer(1.5, victim.kill)
    killer.start()
    results = pool.generate(requests)
    killer.join()
    assert pool.engines[0].restarts == 1, "the killed engine was not restarted"
    assert len(results) == len(requests)
    # Seeded sampling makes each sample a function of its request: equal outputs prove none was lost or swapped.
    assert [r.output_ids for r in results] == [r.output_ids for r in reference]
    assert victim.client.healthy()


def test_hung_engine_is_restarted(engines):
    victim = engines[0]
    victim.client.pause_generation(mode="in_place")  # the scheduler stops: requests hang
    pool = RolloutPool([EngineHandle(victim.client, restart=victim.restart)],
                       PoolConfig(max_concurrency_per_engine=2, request_timeout_s=3.0, backoff_s=0.1))
    results = pool.generate(_requests(3))
    assert len(results) == 3 and pool.engines[0].restarts == 1


def test_hardening_an_engine_whose_port_was_taken_starts_on_another(tmp_path):
    """free_port() picks a port another process may take before the engine binds it: the engine's start-up then
    fails with "Address already in use", and the launcher starts it again on a newly picked port (its client follows)
    instead of failing the run. Here the port is taken on purpose, by a listener held for the whole start-up."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        engine = LocalEngineProcess.mpo_engine(log_path=tmp_path / "engine.log", port=port)
        client = engine.client
        try:
            engine.start()
            assert engine.port != port and client is engine.client and client.url.endswith(f":{engine.port}")
            assert client.healthy(timeout_s=5.0)
            assert f"port {port} was taken" in engine.log_tail(100)
        finally:
            engine.stop()


def test_unreachable_engine_error_names_the_engine():
    url = f"http://127.0.0.1:{free_port()}"
    pool = RolloutPool([EngineHandle(EngineClient(url))], PoolConfig(max_attempts=2, backoff_s=0.01))
    with pytest.raises((EngineError, RuntimeError), match=url.replace(".", r"\.")):
        pool.generate(_requests(1))


def test_http_400_names_the_engine_and_the_reason(engines):
    bad = GenerateRequest((1, 99999), SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineError, match=r"engine http://127\.0\.0\.1:\d+: /generate returned HTTP 400: .*99999"):
        RolloutPool([EngineHandle(engines[1].client)]).generate([bad])


def test_api_key_is_required(engines):
    with pytest.raises(EngineError, match="HTTP 401"):
        EngineClient(engines[1].url).call("/server_info", method="GET")


def test_hardening_api_key_reaches_the_engine_by_environment_not_argv(engines):
    """`ps` shows argv to every user: the key must be only in the engine's environment (readable by its owner)."""
    pid = engines[1].process.pid
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"--api-key" not in argv and b"k" not in argv
    assert b"MPO_API_KEY=k" in environ
    with pytest.raises(EngineError, match="HTTP 401"):  # a wrong key is refused like a missing one
        EngineClient(engines[1].url, api_key="kk").call("/server_info", method="GET")


def test_hardening_engine_cli_refuses_key_on_argv_and_reads_key_file(tmp_path, capsys):
    from mpo.engine.__main__ import api_key, main, parse_args

    assert main(["--port", "1", "--api-key", "K3y"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MPO_API_KEY" in err and "--api-key-file" in err and "K3y" not in err
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert api_key(parse_args(["--port", "1", "--api-key-file", str(key_file)]), {}) == "from-file"
    assert api_key(parse_args(["--port", "1"]), {"MPO_API_KEY": "from-env"}) == "from-env"
    assert api_key(parse_args(["--port", "1"]), {}) is None
    assert main(["--port", "1", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err


@pytest.mark.parametrize("host, key, header, status", [
    ("0.0.0.0", None, None, 403),            # no key, reachable from other hosts: weight routes refused
    ("127.0.0.1", None, None, 200),          # no key on loopback: only this host's users reach it
    ("0.0.0.0", "K3y", "Bearer K3y", 200),   # a key: authenticated requests pass anywhere
    ("0.0.0.0", "K3y", "Bearer K3z", 401),   # same length, wrong key
])
def test_hardening_keyless_engine_serves_weight_routes_only_on_loopback(host, key, header, status):
    """The HTTP layer alone (mpo.engine.server): the generator is not needed for these routes (None), and the disk
    route is a stand-in that records it was reached."""
    import httpx

    from mpo.engine.server import EngineApp, serve

    app = EngineApp(None, info={})
    reached = []
    app.add("POST", "/update_weights_from_disk", lambda body: reached.append(body) or {"success": True})
    port = free_port()
    server = serve(app, host, port, key)
    try:
        headers = {"Authorization": header} if header else {}
        got = httpx.post(f"http://127.0.0.1:{port}/update_weights_from_disk", json={"model_path": "/x"},
                            headers=headers, timeout=30)
        assert got.status_code == status, got.text
        assert bool(reached) == (status == 200)
        if status == 403:
            assert "MPO_API_KEY" in got.json()["message"]
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200  # others serve
    finally:
        server.shutdown()
        server.server_close()


def test_weight_sync_tensor_path_checksum_and_logprobs_follow(engines, tmp_path):
    engine = engines[1]
    prompt = GenerateRequest((1, 2, 3, 4, 5), SamplingParams(temperature=0, max_new_tokens=4))
    before = RolloutPool([EngineHandle(engine.client)]).generate([prompt])[0]
    out = tmp_path / "sync.pt"
    spawn_ranks(1, engine_worker.perturb_and_sync, str(out), engine.url, "k", 32 << 10)
    trainer = torch.load(out, weights_only=True)
    assert trainer["buckets"] > 1  # small buckets: units (QKV, gate/up) span several of them
    # The engine's new greedy output, scored by the trainer with the same new weights.
    after = RolloutPool([EngineHandle(engine.client)]).generate([prompt])[0]
    assert after.weight_version == 1
    spawn_check = tmp_path / "after.pt"
    spawn_ranks(1, engine_worker.score_perturbed, str(spawn_check), list(after.prompt_ids + after.output_ids))
    ref = torch.load(spawn_check, weights_only=True)
    diff = (torch.tensor(after.output_logprobs) - ref[len(after.prompt_ids):]).abs().max().item()
    assert diff <= 1e-5, f"after sync, engine vs trainer log-probs differ by {diff:.3g}"
    assert (torch.tensor(before.output_logprobs) - torch.tensor(after.output_logprobs)).abs().max() > 1e-3


def test_an_engine_awaiting_weights_skips_megatron_and_serves_the_trainers_after_one_sync(tmp_path):
    """A run's engine (EngineSettings.from_config: await_weights) starts from transformers' random init without
    importing megatron-core, and one sync makes it serve the trainer's weights: its log-probs then equal the
    trainer's forward, so every tensor the init left random was replaced."""
    import subprocess

    from mpo.rollout.engine_command import EngineSettings

    probe = subprocess.run([sys.executable, "-c",
                            "import sys\nfrom mpo.engine.model import EngineModel\n"
                            "EngineModel.create(preset='tiny', mcore_dir=None, seed=1, dtype='fp32', fp32_lm_head=True,"
                            " dist_port=None, await_weights=True)\n"
                            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"],
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr[-2000:]
    engine = LocalEngineProcess.mpo_engine(log_path=tmp_path / "engine.log", api_key="k",
                                           settings=EngineSettings(await_weights=True)).start()
    try:
        assert "--await-weights" in engine.command
        out = tmp_path / "sync.pt"
        spawn_ranks(1, engine_worker.perturb_and_sync, str(out), engine.url, "k", 32 << 10)
        prompt = GenerateRequest((1, 2, 3, 4, 5), SamplingParams(temperature=0, max_new_tokens=4))
        after = RolloutPool([EngineHandle(engine.client)]).generate([prompt])[0]
        spawn_ranks(1, engine_worker.score_perturbed, str(tmp_path / "ref.pt"),
                    list(after.prompt_ids + after.output_ids))
        ref = torch.load(tmp_path / "ref.pt", weights_only=True)
        diff = (torch.tensor(after.output_logprobs) - ref[len(after.prompt_ids):]).abs().max().item()
        assert diff <= 1e-5, f"after one sync, engine vs trainer log-probs differ by {diff:.3g}"
    finally:
        engine.stop()


def test_weight_update_shape_mismatch_names_engine_and_tensor(engines):
    from mpo.weight_sync.wire import MPO_FORMAT, encode_mpo_bucket

    client = engines[1].client
    client.begin_weight_update()
    try:
        with pytest.raises(EngineError, match=r"engine http://.*update_weights_from_tensor returned HTTP 400: .*"
                                              r"'lm_head.weight' has shape \(3, 3\)"):
            client.update_weights_from_tensor([encode_mpo_bucket([("lm_head.weight", torch.zeros(3, 3))])],
                                              load_format=MPO_FORMAT)
    finally:
        client.end_weight_update()


def test_weight_update_outside_session_is_refused(engines):
    from mpo.weight_sync.wire import MPO_FORMAT, encode_mpo_bucket

    with pytest.raises(EngineError, match="between begin_weight_update"):
        engines[1].client.update_weights_from_tensor([encode_mpo_bucket([])], load_format=MPO_FORMAT)


def test_weight_sync_distributed_path_reaches_every_engine(engines, tmp_path):
    """Both engines in one gloo group (ranks 1 and 2): after the broadcasts each one's checksum equals the trainer's
    weights' checksum, computed by the trainer from its own model."""
    out = tmp_path / "dist.pt"
    started = time.perf_counter()
    spawn_ranks(1, engine_worker.perturb_and_sync, str(out), [e.url for e in engines], "k", 32 << 10, "distributed")
    trainer = torch.load(out, weights_only=True)
    assert trainer["buckets"] > 1
    for engine in engines:
        assert engine.client.call("/weights_checksum", method="GET")["checksum"] == trainer["checksum"]
    print(f"\n[mpo engine] distributed sync (gloo, 2 engines): {trainer['bytes_per_s'] / 2**20:.1f} MiB/s; "
          f"worker {time.perf_counter() - started:.1f} s")


def test_weight_sync_shm_path_checksum_and_refusals(engines, tmp_path):
    """sync.transport=shm from a plain list of tensors (every bucket through WeightSync's shared spill buffer): the
    engine's checksum equals the trainer's; a locator outside the shm directory, one reaching past its file, and a
    wrong shape are refused with the reason, and the engine still serves."""
    import json
    import os

    from mpo.weight_sync.shared_memory import SharedBuffer, file_name, locate, new_token
    from mpo.weight_sync.wire import SHM_FORMAT

    out = tmp_path / "shm.pt"
    spawn_ranks(1, engine_worker.perturb_and_sync, str(out), engines[1].url, "k", 32 << 10, "shm")
    trainer = torch.load(out, weights_only=True)
    assert trainer["buckets"] > 1
    assert engines[1].client.call("/weights_checksum", method="GET")["checksum"] == trainer["checksum"]
    assert not list(Path("/dev/shm").glob("mpo-sync-*-spill")), "the spill buffer outlived its WeightSync"

    client = engines[1].client
    buffer = SharedBuffer(file_name(new_token(), "test"), 64, torch.float32, create=True)
    good = locate("lm_head.weight", buffer.tensor[:8].view(2, 4)).to_json()
    outside = tmp_path / "mpo-sync-aa-p1-x"
    outside.write_bytes(bytes(1024))
    cases = [({**good, "path": str(outside)}, "is not an mpo-sync-\\* file in /dev/shm"),
             ({**good, "shape": [16, 4]}, "differs from the model's"),
             ({**good, "name": "model.norm.weight", "shape": [64], "stride": [1], "offset": 8},
              "the view ends at element 71 but .* holds 64")]
    client.begin_weight_update()
    try:
        for locator, reason in cases:
            with pytest.raises(EngineError, match=reason):
                client.update_weights_from_tensor([json.dumps([locator])], load_format=SHM_FORMAT)
    finally:
        client.end_weight_update()
        buffer.close()
    assert not os.path.exists(buffer.path)
    assert client.healthy()


def test_distributed_shape_mismatch_names_engine_and_tensor(engines):
    from mpo.bench._util import push_whole
    from mpo.weight_sync.transports import WeightSync

    client = engines[1].client
    sync = WeightSync([client], engine="mpo", transport="distributed")
    try:
        with pytest.raises(EngineError, match=r"engine http://.*update_weights_from_distributed returned HTTP 400: "
                                              r".*'lm_head.weight' has shape \(3, 3\)"):
            push_whole(sync, [("lm_head.weight", torch.zeros(3, 3))], version=1)
        assert client.healthy()
    finally:
        sync.close()


def test_loop_probe_verification_covers_every_expert_and_catches_a_stale_one(tmp_path):
    """The loop's SGLang-style verification run against mpo's engine (which serves the same probe API): the
    covering probe passes after a sync, fails once one expert of the last layer is stale, passes when restored."""
    spawn_ranks(2, engine_worker.covering_probe_in_the_loop, str(tmp_path))
    results = json.loads((tmp_path / "covering_probe.json").read_text())
    print(f"\n[mpo engine] loop probe: {results['probe_tokens']} tokens; fresh diff "
          f"{results['fresh']['sync_probe_logprob_maxdiff']:.1e}; stale: {results['stale_error']}", file=sys.stderr)
    assert results["fresh"]["sync_probe_logprob_maxdiff"] <= 1e-5
    assert results["stale_tensors"] == 3
    assert results["stale_error"] is not None and "probe log-probs differ" in results["stale_error"]
    assert results["restored"]["sync_probe_logprob_maxdiff"] <= 1e-5


def test_colocated_memory_release_and_staged_resume(engines):
    """rollout.colocate's protocol on mpo's engine, SGLang's endpoints and rules (release_memory_occupation needs an
    idle server; tags "weights" / "kv_cache", none = all; resume in two stages around the weight update). Real SGLang
    on CPU cannot serve it: its release calls torch.cuda.synchronize and the server dies; on CPU
    the mpo engine has no device memory to hand back, so what is checked is the state machine."""
    from mpo.weight_sync.wire import MPO_FORMAT, encode_mpo_bucket

    client = engines[1].client
    pool = RolloutPool([EngineHandle(client)])
    long = GenerateRequest((1, 2, 3), SamplingParams(max_new_tokens=200, sampling_seed=1))
    # Paused, the engine holds the request once it arrives: it is in the engine (running, to the release rule) however
    # fast the engine decodes (200 tokens took ~0.2 s once the engine ran transformers' model: a sleep raced it).
    client.pause_generation(mode="in_place")
    running = threading.Thread(target=lambda: pool.generate([long]))
    running.start()
    time.sleep(1.0)
    with pytest.raises(EngineError, match="requests are running"):
        client.release_memory_occupation()
    client.continue_generation()
    running.join()
    client.release_memory_occupation()
    try:
        with pytest.raises(EngineError, match=r"generate: memory of \['kv_cache', 'weights'\] is released"):
            client.call("/generate", _requests(1)[0].to_json())
        client.begin_weight_update()
        try:
            with pytest.raises(EngineError, match=r"memory of \['weights'\] is released"):
                client.update_weights_from_tensor([encode_mpo_bucket([])], load_format=MPO_FORMAT)
            client.resume_memory_occupation(["weights"])
            client.update_weights_from_tensor([encode_mpo_bucket([])], load_format=MPO_FORMAT)  # weights back
        finally:
            client.end_weight_update()
        with pytest.raises(EngineError, match=r"memory of \['kv_cache'\] is released"):
            client.call("/generate", _requests(1)[0].to_json())
        with pytest.raises(EngineError, match="tags=\\['gpu'\\]: expected null or a list of 'weights', 'kv_cache'"):
            client.resume_memory_occupation(["gpu"])
    finally:
        client.resume_memory_occupation(["kv_cache"])
    assert pool.generate(_requests(1))[0].output_ids
