"""Issue 49: a user's path from an HF checkpoint, one test per trap, driving the code as a user does.

Real throughout: tiny genuine transformers checkpoints, the real converter run as its own process, the real `mpo`,
`python -m launch` and `python -m mpo.trainer` command lines. Nothing is faked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.cli import one_line
from helpers.tiny_hf import tiny_qwen3_moe
from mpo.config import ConfigError
from mpo.config_checks import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "mpo" / "recipes" / "demo_cpu.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return tiny_qwen3_moe(tmp_path_factory.mktemp("user") / "hf")


# ---- item 1: one model path; random weights only by name ----------------------------------------------------------

def test_user_hf_dir_alone_is_converted_once_and_reused(tiny_hf, tmp_path, capfd):
    from mpo.model_import import STAMP, ensure_converted

    config = load_config(RECIPE, [f"model.hf_dir={tiny_hf}", f"logging.out_dir={tmp_path / 'run'}"])
    converted = ensure_converted(config)
    target = tmp_path / "run" / "hf_converted"
    assert converted.model.mcore_dir == str(target) and (target / ".metadata").is_file() and (target / STAMP).is_file()
    assert "converting model.hf_dir=" in capfd.readouterr().err

    stamp_mtime = (target / STAMP).stat().st_mtime_ns
    again = ensure_converted(config)  # unchanged folder: reused, nothing printed
    assert again.model.mcore_dir == str(target) and (target / STAMP).stat().st_mtime_ns == stamp_mtime
    assert "converting" not in capfd.readouterr().err

    # the converted weights are the HF folder's, not a random init: the stored embedding equals safetensors' own
    # read of the HF file (the conversion itself is proven against transformers in tests/test_convert_qwen3.py)
    from safetensors import safe_open

    from checkpoints_tools.torch_dist_io import TorchDistReader

    index = json.loads((tiny_hf / "model.safetensors.index.json").read_text())["weight_map"]
    name, key = "model.embed_tokens.weight", "embedding.word_embeddings.weight"
    with safe_open(str(tiny_hf / index[name]), "pt") as handle:
        expected = handle.get_tensor(name)
    assert torch.equal(TorchDistReader(target).read(key), expected)

    os.utime(tiny_hf / "config.json")  # the folder changed: converted again
    ensure_converted(config)
    assert "converting again" in capfd.readouterr().err


def test_user_hf_dir_alone_refuses_a_foreign_convert_dir(tiny_hf, tmp_path):
    from mpo.model_import import ensure_converted

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    config = load_config(RECIPE, [f"model.hf_dir={tiny_hf}", f"model.convert_dir={foreign}"])
    with pytest.raises(ConfigError, match="exists and was not made by mpo"):
        ensure_converted(config)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_user_launch_refuses_hf_dir_alone_in_one_line_with_the_command(tiny_hf, tmp_path):
    out = subprocess.run([sys.executable, "-m", "launch", "--config", str(RECIPE), "--hosts", "n1", "--dry-run",
                          f"model.hf_dir={tiny_hf}", f"logging.out_dir={tmp_path / 'run'}"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    line = one_line(out.stderr)
    assert out.returncode == 2
    assert "would train random weights" in line and "-m checkpoints_tools hf-to-mcore --hf-dir" in line, line
    ok = subprocess.run([sys.executable, "-m", "launch", "--config", str(RECIPE), "--hosts", "n1", "--dry-run",
                         f"model.hf_dir={tiny_hf}", "model.random_init=true", f"logging.out_dir={tmp_path / 'run'}"],
                        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_user_trainer_rank_refuses_hf_dir_alone_in_one_line(tiny_hf, tmp_path):
    """A script or sbatch line that starts the trainer module directly, skipping `mpo train`."""
    out = subprocess.run([sys.executable, "-m", "mpo.trainer", "--config", str(RECIPE), f"model.hf_dir={tiny_hf}",
                          f"logging.out_dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**ENV, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "would train random weights" in out.stderr, out.stderr[-3000:]


def _free_port() -> int:
    from mpo.parallel.ports import free_port

    return free_port()


# ---- item 3: what can be checked before start-up is, in one line ----------------------------------------------------

def _check_config(*overrides: str, env: dict | None = None, command: str = "check-config") -> subprocess.CompletedProcess:
    """The installed `mpo` command as a user types it."""
    mpo = Path(sys.executable).with_name("mpo")
    return subprocess.run([str(mpo), command, "--config", str(RECIPE), *overrides], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    from helpers.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok")  # ~370 tokens, over the tiny preset's 256


def test_user_tokenizer_larger_than_the_vocabulary_is_one_line(big_tokenizer, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": 2}\n')
    out = _check_config(f"model.tokenizer_dir={big_tokenizer}", f"data.task={data}",
                        f"logging.out_dir={tmp_path / 'run'}", command="train")
    line = one_line(out.stderr)
    assert out.returncode == 2 and "the model's vocabulary is 256" in line and "model.tokenizer_dir" in line, line


def test_user_mcore_dir_of_another_architecture_is_one_line(tiny_hf, tmp_path):
    from mpo.model_import import ensure_converted

    mc = ensure_converted(load_config(RECIPE, [f"model.hf_dir={tiny_hf}", f"logging.out_dir={tmp_path}"]))
    out = _check_config(f"model.mcore_dir={mc.model.mcore_dir}")  # the tiny preset has 4 layers, this model 2
    line = one_line(out.stderr)
    assert out.returncode == 2 and "holds another architecture (2 layers)" in line, line


def test_user_sglang_without_urls_and_without_sglang_is_one_line(tmp_path):
    out = _check_config("rollout.engine=sglang", f"logging.out_dir={tmp_path / 'run'}",
                        env={"MPO_ENGINE_PYTHON": "/usr/bin/python3"}, command="train")
    line = one_line(out.stderr)
    assert out.returncode == 2 and "cannot import sglang" in line and "MPO_ENGINE_PYTHON" in line, line


def test_user_unreachable_engine_url_is_one_line_before_any_rank(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    out = _check_config(f"rollout.urls=[{url}]", f"logging.out_dir={tmp_path / 'run'}", command="train")
    line = one_line(out.stderr)
    assert out.returncode == 2 and line.startswith(f"mpo: config error: rollout.urls[0]={url}: no engine answers"), line


def test_user_dataset_without_its_answer_key_fails_check_config(big_tokenizer, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1?", "solution": i + 1}) + "\n" for i in range(20)))
    out = _check_config(f"data.task={data}", "model.tokenizer_dir=" + str(big_tokenizer))
    line = one_line(out.stderr)
    assert out.returncode == 2 and "missing key 'answer'" in line and "qa.jsonl:1" in line, line
    data.write_text("not json\n" + "".join(json.dumps({"prompt": f"{i}+1?", "answer": i + 1}) + "\n"
                                           for i in range(3)))
    assert "missing key" not in _check_config(f"data.task={data}", "model.tokenizer_dir=" + str(big_tokenizer)).stderr


def test_user_ctrl_c_is_one_line_that_says_how_to_resume(tmp_path):
    """Ctrl-C in a terminal: SIGINT to the foreground process group (mpo, torchrun; torchrun forwards it to ranks)."""
    import signal
    import time

    out_dir = tmp_path / "run"
    mpo = Path(sys.executable).with_name("mpo")
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen([str(mpo), "demo", "--steps", "200", "--out", str(out_dir), "logging.progress=false",
                                 "logging.checkpoint_every=2", "eval.every=0", "schedule.sft_steps=0"], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, cwd=tmp_path,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 240
        while not (out_dir / "checkpoints" / "latest").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
    stderr = (tmp_path / "err.txt").read_text()
    assert code == 130, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("mpo: interrupted; its last checkpoint is ") and "rerun the same command" in last, stderr


# ---- item 9: mpo plan totals the GPUs and says "tight" honestly -------------------------------------------------------

def test_user_plan_totals_gpus_and_flags_a_tight_role(capsys):
    from mpo.cli import main

    code = main(["plan", "--config", "mpo/recipes/qwen3_30b_a3b_gspo.yaml"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "of 79.6 GiB: fits, " in out.out and " GB" not in out.out.replace("GiB", "")  # one unit, in and out
    assert out.out.strip().splitlines()[-1] == ("total: 32 GPUs = 16 for the trainer (16 ranks) + 16 for 4 SGLang "
                                                "engines of TP4 on nodes of their own; 4 nodes of 8 GPUs")
    # PPO (policy + critic) at PP2 needs 72.0 GiB: on 75 GiB GPUs that is under 5% free, which is not "fits"
    code = main(["plan", "--config", "mpo/recipes/qwen3_30b_a3b_ppo.yaml", "--gpu-mem-gib", "75"])
    out = capsys.readouterr()
    assert code == 0 and ": TIGHT: fits with 3.0 GiB free, under 5%" in out.out, out.out
    assert out.err.strip().splitlines() == [
        "mpo: memory plan: trainer (pipeline stage 0 of 2) is tight in 75 GiB (under 5% free): expect out-of-memory "
        "errors from fragmentation; lower schedule.micro_batch_size or raise a parallel size"]


# ---- item 8: verify says its result, not the libraries' notices ------------------------------------------------------

@pytest.mark.parametrize("tp", ["1", "2"])
def test_user_verify_prints_its_result_and_no_library_warnings(tiny_hf, tmp_path, tp):
    from mpo.model_import import ensure_converted

    mc = ensure_converted(load_config(RECIPE, [f"model.hf_dir={tiny_hf}", f"logging.out_dir={tmp_path}"]))
    env = {k: v for k, v in ENV.items() if k != "PYTHONWARNINGS"}  # as a user's shell has it
    out = subprocess.run([sys.executable, "-m", "checkpoints_tools", "verify", "--hf-dir", str(tiny_hf), "--mcore-dir",
                          mc.model.mcore_dir, "--tp", tp], capture_output=True, text=True, env=env, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert "Warning" not in out.stdout + out.stderr and "Loading weights" not in out.stderr, lines
    assert lines[0].startswith("layout ") and lines[-1].startswith("PASS") and len(lines) == 6, lines
