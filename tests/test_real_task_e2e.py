"""The path a user takes, end to end on CPU: an HF checkpoint with a real tokenizer -> `checkpoints_tools hf-to-mcore`
-> `mpo train` on a jsonl math dataset (reward.fn=math), once with mpo's engine and once with real SGLang loading the
HF directory -> `checkpoints_tools mcore-to-hf` -> transformers loads the export, and its log-probs equal the trainer's.

Nothing is faked: the tokenizer is a byte-level BPE trained in the test (Qwen-style special tokens and chat template),
the model a genuine random `Qwen3MoeForCausalLM`, every step goes through the CLIs a user types. The reference for the
final weights is transformers' own forward on the exported directory.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import e2e_worker, recipe_worker
from helpers.sglang_server import sglang_available, start_sglang_server
from helpers.spawn import spawn_ranks
from helpers.tiers import tier_unavailable
from helpers.tiny_hf import make_tiny_qwen3_moe
from helpers.tiny_tokenizer import DEFAULT_TEXTS, build_tiny_tokenizer
from mpo.config import RECIPES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 512  # >= the BPE's size; ids past the tokenizer decode to nothing
STEPS = 3


def _math_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": f"What is {a} plus {b}? Put the answer in \\boxed{{}}.", "answer": str(a + b),
                     "level": "easy"})
    return rows


def _cli(args: list[str], log: Path, timeout: float = 900, expect: int = 0) -> str:
    # helpers/ on the path of every process the CLI starts: reward workers import the test's plug-in from there
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "helpers"), os.environ.get("PYTHONPATH", "")])}
    with open(log, "ab") as f:
        code = subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env=env).returncode
    assert code == expect, f"{' '.join(args[:3])} exited {code}:\n" + log.read_text()[-4000:]
    return log.read_text()


@pytest.fixture(scope="module")
def user_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    rows = _math_rows(48)
    data = base / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = base / "held_out.jsonl"  # the evaluation's own file (eval.task)
    held_out.write_text("".join(json.dumps(r) + "\n" for r in _math_rows(3, seed=99)))
    hf = make_tiny_qwen3_moe(base / "hf", seed=5, vocab=VOCAB)
    texts = [*DEFAULT_TEXTS, *(r["prompt"] + " " + r["answer"] for r in rows)]
    build_tiny_tokenizer(hf, texts)  # replaces the word-level tokenizer: <|im_end|> (id 2) is the EOS
    _cli(["-m", "checkpoints_tools", "hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(base / "mc"),
          "--no-progress"], base / "convert.log")
    return {"base": base, "hf": hf, "mc": base / "mc", "data": data, "held_out": held_out}


def _train(ckpt: dict, out: Path, *extra: str, expect: int = 0) -> list[dict] | str:
    output = _cli(["-m", "mpo.cli", "train", "--config", str(RECIPES / "demo_cpu.yaml"), f"model.hf_dir={ckpt['hf']}",
          f"model.mcore_dir={ckpt['mc']}", f"data.task={ckpt['data']}", "reward.fn=math", f"schedule.steps={STEPS}",
          "schedule.sft_steps=0", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
          "rollout.max_new_tokens=12", "schedule.micro_batch_size=8", "algorithm.filter_zero_variance=false",
          f"logging.out_dir={out}", "logging.tensorboard=false", "logging.progress=false",
          "logging.checkpoint_every=0", *extra], out.parent / f"{out.name}.log", expect=expect)
    if expect:
        return output
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if "reward_mean" in line]  # RL steps (a final evaluation's row is not one)


def _check_metrics(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == list(range(STEPS))
    for row in rows:
        for key in ("reward_mean", "loss", "reward_errors"):
            assert isinstance(row[key], float), (key, row)
        assert row["reward_errors"] == 0.0


@pytest.fixture(scope="module")
def mpo_engine_run(user_checkpoint):
    out = user_checkpoint["base"] / "run_mpo"
    return out, _train(user_checkpoint, out, "rollout.engine=mpo", "eval.every=2", "eval.samples_per_prompt=2",
                       f"eval.task={user_checkpoint['held_out']}")


def test_e2e_mpo_engine_trains_on_a_jsonl_math_task(mpo_engine_run):
    out, rows = mpo_engine_run
    _check_metrics(rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == set(range(STEPS))
    first = samples[0]
    assert first["prompt"].startswith("<|im_start|>user\nWhat is") or "What is" in first["prompt"]
    assert isinstance(first["response"], str) and first["answer"].isdigit()
    # Held-out evaluation on a text task (issue #27): the 3 rows of eval.task, 2 samples each, scored by the math
    # reward, before steps 0 and 2 and after the last step.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean@2" in r]
    assert [r["step"] for r in evals] == [0, 2, STEPS]
    assert all(0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1 and r["eval/reward_errors"] == 0 for r in evals)
    per_prompt = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    held_out = {json.loads(line)["answer"] for line in Path(out.parent / "held_out.jsonl").read_text().splitlines()}
    assert len(per_prompt) == 3 * 3 and {r["answer"] for r in per_prompt} == held_out
    assert all("What is" in r["prompt"] and len(r["rewards"]) == 2 for r in per_prompt)


def test_e2e_export_matches_transformers(mpo_engine_run, user_checkpoint, tmp_path):
    """The trained weights, exported by mcore-to-hf, give transformers the trainer's log-probs (fp32, <= 1e-5)."""
    from transformers import AutoModelForCausalLM

    out, _ = mpo_engine_run
    rng = random.Random(1)
    sequences = [[rng.randrange(3, 360) for _ in range(n)] for n in (7, 12)]
    spawn_ranks(2, e2e_worker.score, str(out), sequences, str(tmp_path / "trainer.json"), str(tmp_path / "mc"))
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    assert trainer["step"] == STEPS
    _cli(["-m", "checkpoints_tools", "mcore-to-hf", "--mcore-dir", str(tmp_path / "mc"), "--out-dir",
          str(tmp_path / "hf"), "--hf-config", str(user_checkpoint["hf"] / "config.json"), "--no-progress"],
         tmp_path / "export.log")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(str(user_checkpoint["hf"]), dtype=torch.float32).eval()
    for seq, trained in zip(sequences, trainer["logprobs"]):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            before = torch.log_softmax(original(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert (logp - torch.tensor(trained, dtype=torch.float64)).abs().max() <= 1e-5
        assert (before - logp).abs().max() > 1e-4, "training did not move the weights: the check would be vacuous"


def test_reasoning_gym_task_with_a_raising_and_hanging_reward_keeps_training(user_checkpoint):
    """`mpo train` on reasoning_gym:basic_arithmetic with a plug-in verifier that raises on some responses and hangs
    on others: every step runs, hung and raising ones score 0 and count in reward_errors."""
    out = user_checkpoint["base"] / "run_reasoning_gym"
    rows = _train(user_checkpoint, out, "rollout.engine=mpo", "data.task=reasoning_gym:basic_arithmetic?size=64&seed=1",
                  "reward.fn=flaky_reward:score", "reward.timeout_s=2", "world_size=1", "parallel.expert_parallel=1",
                  "schedule.steps=2")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(isinstance(r["reward_mean"], float) for r in rows)
    assert sum(r["reward_errors"] for r in rows) > 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all("reasoning_gym:basic_arithmetic#" in s["source"] for s in samples), samples[0]


def test_bad_row_stops_the_run_with_one_line_naming_file_line_and_key(user_checkpoint, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "What is 1 plus 1?", "answer": "2"}\n{"prompt": "What is 2 plus 2?", "answer": "4"}\n'
                    '{"prompt": "What is 3 plus 3?" "answer": "6"}\n')
    output = _train(user_checkpoint, tmp_path / "run", "rollout.engine=mpo", f"data.task={data}", "world_size=1",
                    "parallel.expert_parallel=1", expect=1)
    lines = [line for line in output.splitlines() if f"{data}:3" in line]
    assert lines and "invalid JSON" in lines[0], output[-2000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.fixture(scope="module")
def sglang_server(user_checkpoint, request):
    """One real SGLang server on the user's HF directory for the module (the e2e run and every SGLang recipe)."""
    ok, reason = sglang_available()
    if not ok:
        tier_unavailable("SGLANG", reason, request)
    with start_sglang_server(user_checkpoint["hf"], log_path=user_checkpoint["base"] / "sglang.log",
                             fp32_lm_head=True) as server:
        yield server


def test_e2e_sglang_trains_on_the_hf_directory(user_checkpoint, sglang_server):
    rows = _train(user_checkpoint, user_checkpoint["base"] / "run_sglang", "rollout.engine=sglang",
                  f"rollout.urls=[{sglang_server.url}]")
    _check_metrics(rows)
    assert all(r["sync_probe_logprob_maxdiff"] <= 1e-3 for r in rows)  # the server follows the trainer's weights


def test_env_sglang_trains_with_the_calculator_environment(user_checkpoint, sglang_server):
    """Multi-turn episodes (issue #28) through real SGLang on the shared server: the calculator environment, R3 (the
    last turn's routed experts must cover the whole sequence, observation and earlier turns included, or the
    response is refused for its row count), every step with more than one turn and loss on a strict part of the
    response side."""
    rows = _train(user_checkpoint, user_checkpoint["base"] / "run_sglang_env", "rollout.engine=sglang",
                  f"rollout.urls=[{sglang_server.url}]", "rollout.env=calculator", "reward.fn=null",
                  f"data.task={RECIPES / 'data' / 'calculator.jsonl'}", "rollout.max_turns=2",
                  "rollout.max_tokens_per_turn=6", "algorithm.replay=r3", "schedule.steps=2")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["env_turns_mean"] > 1 and 0 < row["loss_token_frac"] < 1 and row["env_errors"] == 0, row
        assert row["sync_probe_logprob_maxdiff"] <= 1e-3
        assert row["routing/old_replay/forced_frac"] >= 0  # R3 replayed the engine's routes


RECIPES_BY_ENGINE = {engine: sorted(str(p) for p in RECIPES.glob("*.yaml")
                                    if ("engine: sglang" in p.read_text()) == (engine == "sglang"))
                     for engine in ("mpo", "sglang")}


@pytest.fixture(scope="module")
def mpo_engine(user_checkpoint):
    """One mpo engine on the user's HF directory, for every mpo-engine recipe."""
    from mpo.rollout.engine_command import EngineSettings
    from mpo.rollout.local_engine import LocalEngineProcess

    process = LocalEngineProcess.mpo_engine(log_path=user_checkpoint["base"] / "mpo_engine.log",
                                            settings=EngineSettings(hf_dir=str(user_checkpoint["hf"])),
                                            num_layers=2, topk=2).start()
    yield process
    process.stop()


def _recipes_step(user_checkpoint, engine: str, url: str, out: Path) -> dict:
    spawn_ranks(2, recipe_worker.run, str(out), str(user_checkpoint["hf"]), str(user_checkpoint["mc"]),
                RECIPES_BY_ENGINE[engine], {engine: url})
    results = json.loads((out / "recipes.json").read_text())
    assert sorted(results) == sorted(Path(r).stem for r in RECIPES_BY_ENGINE[engine])
    return results


def _check_recipe_step(name: str, result: dict) -> None:
    step = result["step"]
    assert step["sync_bytes"] > 0, name
    assert "reward_mean" in step and step["reward_errors"] == 0.0, name
    if "loss" in step:  # a critic-warm-up step (VAPO) trains only the critic
        assert step["loss"] == step["loss"], name  # finite
    else:
        assert "critic/value_loss" in step, name


def test_every_mpo_engine_recipe_runs_a_step(user_checkpoint, mpo_engine, tmp_path):
    """The CPU recipes (toy tasks, mpo's engine, tensor sync), each one step on the tiny checkpoint."""
    results = _recipes_step(user_checkpoint, "mpo", mpo_engine.url, tmp_path)
    assert RECIPES_BY_ENGINE["mpo"], "no mpo-engine recipe found"
    for name, result in results.items():
        assert result["engine"] == "mpo" and result["task"].startswith("toy:"), name
        _check_recipe_step(name, result)


def test_every_sglang_recipe_runs_a_step(user_checkpoint, sglang_server, tmp_path):
    """The GPU recipes shrunk to 2 CPU ranks: their jsonl math data and reward, SGLang, distributed sync (verified
    by the covering probe after the step), routing replay R3, critic where they have one."""
    results = _recipes_step(user_checkpoint, "sglang", sglang_server.url, tmp_path)
    assert len(results) >= 9
    for name, result in results.items():
        assert result["engine"] == "sglang" and result["sync"] == "distributed", name
        assert result["task"].endswith(".jsonl"), name
        _check_recipe_step(name, result)
        assert result["step"]["sync_probe_logprob_maxdiff"] <= 1e-3, name


# ---- issue #49: the README's real-task commands, as printed, with a Ctrl-C and a resume in between ---------------

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_commands() -> list[str]:
    """The command lines of the README's real-task block (the indented lines after its marker comment)."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("<!-- real-task commands"))
    block = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    assert len(block) == 2 and block[0].startswith(".venv/bin/mpo train ") and " export " in block[1], block
    return block


def test_e2e_readme_commands_train_from_hf_dir_alone_survive_ctrl_c_and_export(user_checkpoint, sglang_server,
                                                                             tmp_path):
    """`mpo train` with only model.hf_dir (converted once), the text recipe, held-out evaluation and W&B offline ->
    Ctrl-C after the first checkpoint -> the same command again resumes -> `mpo export` -> transformers loads the
    export and its log-probs equal the trainer's (<= 1e-5) -> SGLang loads the same folder (/update_weights_from_disk
    into the module's server) and gives the same log-probs (<= 1e-3). The README's lines run through bash with its
    variables set; the train line gets the test's sizes appended (a few short steps instead of 50 of 256 tokens)."""
    import signal
    import time

    train, export = _readme_commands()
    repo = README.parent
    run = tmp_path / "run"
    env = {**os.environ, "HF": str(user_checkpoint["hf"]), "DATA": str(user_checkpoint["data"]),
           "HELD_OUT": str(user_checkpoint["held_out"]), "RUN": str(run), "WANDB_MODE": "offline",
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    sizes = ("schedule.steps=4 rollout.max_new_tokens=12 eval.every=2 eval.prompts=3 logging.checkpoint_every=1 "
             "logging.wandb=true logging.progress=false")
    command = f"{train} {sizes}"

    with open(tmp_path / "first.log", "w") as log:  # Ctrl-C in a terminal: SIGINT to the whole foreground group
        proc = subprocess.Popen(["bash", "-c", command], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 600
        while not (run / "checkpoints" / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=180) == 130, (tmp_path / "first.log").read_text()[-3000:]
    first = (tmp_path / "first.log").read_text()
    assert "Traceback" not in first and first.strip().splitlines()[-1].startswith("mpo: interrupted; its last "
                                                                                   "checkpoint is "), first[-3000:]
    assert (run / "hf_converted" / ".metadata").is_file()  # model.hf_dir alone: converted once, not random weights

    second = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "converting" not in second.stderr  # the conversion is reused
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward_mean" in r]
    assert steps == list(range(4)), steps  # resumed: no step lost or repeated
    assert any("eval/mean@2" in r for r in rows)
    assert list((run / "wandb").glob("offline-run-*")), "W&B offline wrote nothing"

    done = subprocess.run(["bash", "-c", export], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = run / "export"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    rng = random.Random(2)
    sequences = [[rng.randrange(3, 360) for _ in range(n)] for n in (9, 14)]
    spawn_ranks(1, e2e_worker.score, str(run), sequences, str(tmp_path / "trainer.json"), str(tmp_path / "mc"))
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    assert trainer["step"] == 4
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(str(exported)).chat_template  # the tokenizer and its template came along
    reference = []
    for seq, trained in zip(sequences, trainer["logprobs"]):
        ids = torch.tensor([seq])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert (logp - torch.tensor(trained, dtype=torch.float64)).abs().max() <= 1e-5
        reference.append(logp)

    import httpx

    url = sglang_server.url
    headers = sglang_server.headers
    loaded = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(exported)}, timeout=600,
                        headers=headers)
    assert loaded.status_code == 200 and loaded.json().get("success", True), loaded.text
    try:
        for seq, logp in zip(sequences, reference):
            answer = httpx.post(f"{url}/generate", json={"input_ids": seq, "return_logprob": True,
                                                          "logprob_start_len": 0,
                                                          "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                                timeout=600, headers=headers).json()
            served = torch.tensor([entry[0] for entry in answer["meta_info"]["input_token_logprobs"][1:]],
                                  dtype=torch.float64)
            assert (served - logp).abs().max() <= 1e-3
    finally:  # the module's server back on the user's original weights
        httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(user_checkpoint["hf"])}, timeout=600,
                   headers=headers)
