"""Multi-turn rollouts with an environment (issue #28): the token layout of an episode, the loss mask, the engine's
log-probs and routes across turns, environments that misbehave, and `mpo train` with the shipped calculator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import env_worker
from helpers.spawn import spawn_ranks
from helpers.tiny_tokenizer import DEFAULT_TEXTS, build_tiny_tokenizer
from mpo.config import RECIPES
from mpo.config import ConfigError
from mpo.config_checks import load_config, validate
from mpo.rollout.protocol import GenerateResult

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CALC_RECIPE = RECIPES / "envs" / "calculator_cpu.yaml"  # outside recipes/*.yaml: validates only with a tokenizer
SCRIPTED = "helpers.scripted_env:ScriptedEnv"
FLAKY = "helpers.scripted_env:FlakyEnv"
# The observation the Qwen-style template (helpers.tiny_tokenizer) gives "RESULT 42" after an assistant turn, with
# the next generation prompt: written out here from the template's definition, not rendered by mpo.
OBS_AFTER_EOS = "\n<|im_start|>tool\nRESULT 42<|im_end|>\n<|im_start|>assistant\n"
OBS_AFTER_CUT = "<|im_end|>" + OBS_AFTER_EOS


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    texts = [*DEFAULT_TEXTS, "What is 123 * 456? Answer: 56088 <calc>123*456</calc> RESULT 42 tool"]
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", texts, vocab_size=256)


@pytest.fixture(scope="module")
def calc_model(tokenizer_dir, tmp_path_factory):
    """A tiny HF Qwen3-MoE (vocabulary 512) with the test's tokenizer: `mpo train` refuses a tokenizer larger than
    the model's vocabulary, and a byte-level one always has 256 + 3 tokens, past the tiny preset's 256."""
    from helpers.tiny_hf import make_tiny_qwen3_moe

    hf = make_tiny_qwen3_moe(tmp_path_factory.mktemp("calc") / "hf", seed=3, vocab=512)
    for file in tokenizer_dir.iterdir():
        if file.is_file():
            shutil.copy(file, hf / file.name)
    return hf


@pytest.fixture(scope="module")
def convert_dir(calc_model, tmp_path_factory):
    """One model.convert_dir for the module's runs: the first `mpo train` converts model.hf_dir there, the others
    reuse it (mpo.model_import's stamp; ~7 s of conversion per run saved)."""
    return tmp_path_factory.mktemp("calc_converted") / "mc"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from mpo.data.chat import load_tokenizer

    return load_tokenizer(str(tokenizer_dir))


def _renderer(tokenizer):
    from mpo.data.chat import PromptEncoder
    from mpo.envs.render import TurnRenderer

    return TurnRenderer(PromptEncoder(tokenizer), (tokenizer.convert_tokens_to_ids("<|im_end|>"),))


class _Prompt:
    def __init__(self, fields: dict, source: str = "rows.jsonl:1") -> None:
        self.fields, self.source, self.ids, self.answer = fields, source, (5, 6), fields.get("answer")


class _ScriptedEngine:
    """Stands in for the engines: each turn's tokens come from `turns` (per turn, the same for every episode);
    routes are [prompt+completion-1, 1, 2] with each row holding its position, versions 3 (as mpo.rollout.protocol
    parses the engine's "3")."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.calls = turns, []

    def __call__(self, requests):
        out = self.turns[len(self.calls)]
        self.calls.append(requests)
        results = []
        for q in requests:
            rows = len(q.input_ids) + len(out) - 1
            routes = np.repeat(np.arange(rows, dtype=np.int32)[:, None, None], 2, axis=2)
            results.append(GenerateResult(list(q.input_ids), list(out), [-0.5 - 0.01 * k for k in range(len(out))],
                                          {"type": "stop"}, routed_experts=routes,
                                          meta={"output_token_weight_versions": [3] * len(out)}))
        return results, 0


def _episodes(tokenizer, env: str, rows: list[dict], turns: list[list[int]], *, max_turns: int = 2,
              timeout_s: float = 20.0):
    from mpo.envs.pool import EnvPool
    from mpo.envs.rollout import run_episodes
    from mpo.rollout.protocol import SamplingParams

    engine = _ScriptedEngine(turns)
    with EnvPool(env, timeout_s=timeout_s, workers=2) as pool:
        out = run_episodes([_Prompt(r) for r in rows], 1, pool=pool, renderer=_renderer(tokenizer), generate=engine,
                           sampling=SamplingParams(max_new_tokens=8), seeds=list(range(len(rows))),
                           max_turns=max_turns, context_length=512, want_routes=True)
    return (*out, engine)


def test_env_episode_is_prompt_turns_and_rendered_observation_exactly(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn1 = [int(t) for t in tokenizer("<calc>123*456</calc>", add_special_tokens=False)["input_ids"]] + [eos]
    turn2 = [int(t) for t in tokenizer("Answer: 56088", add_special_tokens=False)["input_ids"]]  # cut by length
    results, rewards, stats, _, engine = _episodes(tokenizer, SCRIPTED, [{"prompt": "What is 123 * 456?"}],
                                                   [turn1, turn2])
    (r,) = results
    # transformers' own rendering of the opening, independent of mpo's bounded template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 123 * 456?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert r.prompt_ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    obs = tokenizer(OBS_AFTER_EOS, add_special_tokens=False)["input_ids"]
    assert r.output_ids == turn1 + obs + turn2
    assert r.meta["loss_mask"] == [1.0] * len(turn1) + [0.0] * len(obs) + [1.0] * len(turn2)
    assert r.output_logprobs[len(turn1):len(turn1) + len(obs)] == [0.0] * len(obs)
    assert r.output_logprobs[-len(turn2):] == [-0.5 - 0.01 * k for k in range(len(turn2))]
    # turn 2's request carried the observation in its context; the row's routes are that (last) call's, one row
    # per position but the last: the prefill of the prompt, turn 1 and the observation included
    assert list(engine.calls[1][0].input_ids) == r.prompt_ids + turn1 + obs
    assert r.routed_experts.shape[0] == len(r.prompt_ids) + len(r.output_ids) - 1
    assert r.routed_experts[:, 0, 0].tolist() == list(range(len(r.prompt_ids) + len(r.output_ids) - 1))
    assert r.meta["output_token_weight_versions"] == [3] * len(r.output_ids)
    assert rewards == [0.75] and stats.turns == 2 and stats.errors == 0
    assert stats.metrics()["loss_token_frac"] == (len(turn1) + len(turn2)) / len(r.output_ids)


def test_env_turn_cut_by_length_is_closed_as_the_template_closes_a_turn(tokenizer):
    turn1 = [int(t) for t in tokenizer("What", add_special_tokens=False)["input_ids"]]  # no EOS: cut by length
    results, *_ = _episodes(tokenizer, SCRIPTED, [{"prompt": "q"}], [turn1, turn1])
    obs = tokenizer(OBS_AFTER_CUT, add_special_tokens=False)["input_ids"]
    assert results[0].output_ids == turn1 + obs + turn1


def test_env_that_raises_hangs_crashes_or_returns_garbage_costs_only_its_episode(tokenizer):
    modes = ["raise_init", "raise", "hang", "garbage", "garbage_messages", "nan", "crash", "ok", "ok"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    results, rewards, stats, _, _ = _episodes(tokenizer, FLAKY, [{"prompt": "q", "mode": m} for m in modes],
                                              [[7, eos], [8, eos]], timeout_s=3.0)
    assert rewards == [0.0] * 7 + [0.75, 0.75]
    assert stats.errors == 7 and [r.meta["env_error"] for r in results] == [True] * 7 + [False] * 2
    assert results[0].output_ids == []  # failed at construction: no turn
    assert all(len(r.output_ids) == 2 for r in results[1:7])  # failed after turn 1: its tokens, reward 0
    assert all(r.meta["env_turns"] == 2 for r in results[7:])


@pytest.mark.parametrize("overrides, message", [
    (["reward.fn=math"], "rollout.env="),
    (["data.task=toy:reverse"], "needs a text task"),
    (["rollout.env=nosuchmodule_xyz:Env"], "rollout.env: environment 'nosuchmodule_xyz:Env': cannot import"),
    (["rollout.max_turns=0"], "rollout.max_turns"),
])
def test_env_config_errors_are_one_line(tokenizer_dir, overrides, message):
    data = RECIPES / "data" / "calculator.jsonl"
    with pytest.raises(ConfigError) as info:
        validate(load_config(CALC_RECIPE, [f"model.tokenizer_dir={tokenizer_dir}",
                                                               f"data.task={data}", *overrides]))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def two_turn(tokenizer_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("two_turn")
    data = base / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} plus 30?", "answer": str(a + 30)}) + "\n"
                            for a in (12, 7, 21)))
    spawn_ranks(1, env_worker.two_turn, str(base), [
        f"model.tokenizer_dir={tokenizer_dir}", f"data.task={data}", f"rollout.env={SCRIPTED}", "rollout.max_turns=2",
        "rollout.max_tokens_per_turn=6", "algorithm.replay=r3", "world_size=1", "parallel.expert_parallel=1",
        "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "schedule.micro_batch_size=4",
        "algorithm.filter_zero_variance=false", "schedule.sft_steps=0", "reward.workers=1"])
    return json.loads((base / "two_turn.json").read_text())


def test_env_two_turn_sequence_mask_logprobs_and_routes_through_the_trainer(two_turn, tokenizer):
    """mpo's engine (fp32) and the Trainer: the trained row is prompt + turn 1 + rendered observation + turn 2 as
    generated; the loss mask is exactly the generated tokens; turn 2's engine log-probs (sampled with the
    observation in context) equal the trainer's old forward; R3 replays the engine's routes at every position, the
    observation's included, and those are the routes the trainer's own router picks too (fp32); packed rows
    give the same mask and log-probs (<= 1e-5)."""
    calls, rows = two_turn["calls"], two_turn["rows"]
    assert len(calls) == 2 and len(rows) == 4
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, row in enumerate(rows):
        first, second = calls[0][i], calls[1][i]
        turn1, turn2 = first["output"], second["output"]
        obs_text = OBS_AFTER_EOS if turn1[-1] == eos else OBS_AFTER_CUT
        obs = tokenizer(obs_text, add_special_tokens=False)["input_ids"]
        assert second["input"] == first["input"] + turn1 + obs
        assert row["ids"] == first["input"] + turn1 + obs + turn2 and row["prompt_len"] == len(first["input"])
        mask = [1.0] * len(turn1) + [0.0] * len(obs) + [1.0] * len(turn2)
        assert row["loss_mask"] == mask and row["batch_mask"] == mask
        # sequence packing keeps the mask and the log-probs of every token (the same rows packed end to end)
        assert row["packed_mask"] == mask
        assert np.abs(np.array(row["packed_logprobs"]) - np.array(row["trainer_logprobs"])).max() <= 1e-5
        assert row["reward"] == 0.75
        # turn 2's engine log-probs vs the trainer's (fp32), with the observation in the context
        t2 = slice(len(turn1) + len(obs), None)
        assert row["rollout_logprobs"][t2] == second["logprobs"]
        diff = np.abs(np.array(row["trainer_logprobs"][t2]) - np.array(second["logprobs"]))
        assert diff.max() <= 1e-5, diff
        diff1 = np.abs(np.array(row["trainer_logprobs"][:len(turn1)]) - np.array(first["logprobs"]))
        assert diff1.max() <= 1e-5, diff1
        # R3: the last call's routes cover every position but the last, and are what the old forward replayed
        n = len(row["ids"])
        engine = np.sort(np.array(row["engine_routes"]), -1)
        assert engine.shape[0] == n - 1 and engine.shape[0] == len(second["routes"])
        assert (np.sort(np.array(row["replayed"]), -1) == engine).all()
        obs_at = slice(len(first["input"]) + len(turn1) - 1, len(first["input"]) + len(turn1) + len(obs))
        assert (np.sort(np.array(row["natural"]), -1)[obs_at] == engine[obs_at]).all()
        # the last call's prefill routes of the first turn's context equal the first call's own
        assert (np.sort(np.array(first["routes"]), -1)[:len(first["input"]) - 1] ==
                engine[:len(first["input"]) - 1]).all()
    metrics = two_turn["metrics"]
    assert metrics["env_turns_mean"] == 2.0 and metrics["env_errors"] == 0.0
    assert 0 < metrics["loss_token_frac"] < 1 and metrics["env_time_s"] >= 0
    assert two_turn["old_metrics"]["train_rollout_logprob_absdiff"] <= 1e-5


def _cli(args: list[str], log: Path, timeout: float = 900) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    with open(log, "ab") as f:
        code = subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env=env).returncode
    assert code == 0, f"{' '.join(args[:3])} exited {code}:\n" + log.read_text()[-4000:]


def _train(model_dir: Path, convert_dir: Path, out: Path, *extra: str) -> list[dict]:
    _cli(["-m", "mpo.cli", "train", "--config", str(CALC_RECIPE),
          f"model.hf_dir={model_dir}", f"model.convert_dir={convert_dir}", "schedule.steps=2",
          f"data.task={RECIPES / 'data' / 'calculator.jsonl'}", f"logging.out_dir={out}",
          "logging.tensorboard=false", "logging.progress=false", "logging.checkpoint_every=0", *extra],
         out.parent / f"{out.name}.log")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]


def test_env_mpo_train_with_the_calculator_environment(calc_model, convert_dir, tmp_path):
    rows = _train(calc_model, convert_dir, tmp_path / "calc")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["env_turns_mean"] > 1 and 0 < r["loss_token_frac"] < 1, r
        assert r["env_errors"] == 0 and r["env_time_s"] >= 0 and isinstance(r["loss"], float)


def test_env_mpo_train_keeps_going_when_the_environment_fails(calc_model, convert_dir, tmp_path):
    """FlakyEnv raises, hangs or returns garbage on some turns (by a hash of the text): those episodes score 0 and
    count in env_errors, the run finishes its steps."""
    rows = _train(calc_model, convert_dir, tmp_path / "flaky", f"rollout.env={FLAKY}", "reward.timeout_s=2",
                  "schedule.mode=one_step_off")
    assert [r["step"] for r in rows] == [0, 1]
    assert sum(r["env_errors"] for r in rows) > 0


def test_env_readme_example_is_complete_and_runs(tokenizer, tmp_path, monkeypatch):
    """The README's environment, as printed there (under 30 lines), runs episodes through the pool's workers."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("  ```python\n", 1)[1].split("\n  ```\n", 1)[0]
    source = "\n".join(line[2:] for line in block.splitlines())
    assert len(source.splitlines()) < 30
    (tmp_path / "my_env.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get this process's sys.path
    five = [int(t) for t in tokenizer("5", add_special_tokens=False)["input_ids"]]
    results, rewards, stats, _, _ = _episodes(tokenizer, "my_env:Guess", [{"prompt": "Guess.", "answer": "5"},
                                                                         {"prompt": "Guess.", "answer": "7"}],
                                              [five, five, five], max_turns=3)
    assert stats.errors == 0 and rewards[0] == 1.0 and abs(rewards[1] + 0.3) < 1e-12
    assert [r.meta["env_turns"] for r in results] == [1, 3]


def test_env_per_token_advantages_skip_observation_tokens():
    """A multi-turn row's per-token advantages equal those of the same row with its observation tokens removed
    (reinforce_pp: the next generated token is a token's successor; whitening over generated tokens only), and are
    0 at the observation."""
    import torch

    from mpo.algorithms.step_advantages import AdvantageConfig, StepAdvantages

    rewards, groups = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 1])
    masks = [[1, 1, 0, 0, 0, 1], [1, 0, 1, 1], [1, 1, 1]]
    for name, args in (("reinforce_pp", {"gamma": 0.9}), ("reinforce_pp_baseline", {})):
        estimator = StepAdvantages(AdvantageConfig(name, args))
        holey, _ = estimator(rewards, groups, [len(m) for m in masks], [[float(x) for x in m] for m in masks])
        compact, _ = estimator(rewards, groups, [sum(m) for m in masks])
        for row, mask, ref in zip(holey, masks, compact):
            assert [a for a, m in zip(row, mask) if not m] == [0.0] * (len(mask) - sum(mask))
            assert np.allclose([a for a, m in zip(row, mask) if m], ref, rtol=0, atol=1e-12), (name, row, ref)


def test_env_mpo_train_survives_every_episode_failing_under_r3(calc_model, convert_dir, tmp_path):
    """Environments that cannot even be built: every episode fails before its first turn (reward 0, env_errors),
    no row has a generated token, and the steps run (nothing to train on; R3 has no routes to ask for)."""
    rows = _train(calc_model, convert_dir, tmp_path / "broken", "rollout.env=helpers.scripted_env:BrokenEnv",
                  "algorithm.replay=r3")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["env_errors"] == 8 and r["env_turns_mean"] == 0 and r["skipped_no_signal"] == 1 for r in rows), rows


def test_env_async_with_a_critic_checkpoints_the_producer_process_data_position_and_resumes_from_it(
        calc_model, convert_dir, tmp_path):
    """PPO's GAE critic (values and returns over a loss mask with the observation's hole) in async mode (in-flight
    weight updates, per-token versions): the steps run with finite losses and the env metrics.

    The producer process (mpo.trainer.producer) draws the prompts, so the checkpoint keeps its data position (rank
    0's own task never draws), and a resumed run's producer goes on from the saved position: 2 more steps end
    further on than the first 2 did, where a producer that started the stream again would end at the same place.
    (Batches drawn ahead of a checkpoint count in its position: mpo.trainer.schedule's Resume.) One run directory
    serves both claims (they were two tests, each its own async `mpo train` of the same recipe)."""
    out = tmp_path / "async_resume"
    critic = ("schedule.mode=async", "algorithm.advantage=gae", "algorithm.loss=grpo",
              f"rollout.env={SCRIPTED}")  # reward 0.75 against values from 0: a signal

    def position() -> tuple[int, int]:
        latest = (out / "checkpoints" / "latest").read_text().strip()
        stream = json.loads((out / "checkpoints" / latest / "trainer_state.json").read_text())["task"]["data"]["stream"]
        return stream["epoch"], stream["position"]

    def check_critic(rows: list[dict]) -> None:
        for r in rows:
            assert r["env_turns_mean"] == 2 and 0 < r["loss_token_frac"] < 1, r
            assert np.isfinite(r["loss"]) and r["loss"] != 0 and r["critic/value_loss"] > 0, r

    rows = _train(calc_model, convert_dir, out, *critic, "schedule.steps=2")
    assert [r["step"] for r in rows] == [0, 1]
    check_critic(rows)
    first = position()
    assert first > (0, 0)
    rows = _train(calc_model, convert_dir, out, *critic, "schedule.steps=4")
    assert [r["step"] for r in rows] == list(range(4))
    check_critic(rows[2:])
    assert position() > first, (first, position())
