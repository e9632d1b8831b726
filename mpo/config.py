"""One configuration drives a run: dataclasses loaded from YAML, overridable as `section.field=value` on the command
line, validated before any process starts. Unknown fields and bad values fail with one line naming the field."""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from mpo.parallel.config import LayoutError, ParallelConfig

RECIPES = Path(__file__).parent / "recipes"  # the shipped recipes (`mpo demo`, the benches, the tests)


class ConfigError(ValueError):
    """A configuration problem, with the dotted field name in the message."""


@dataclass(frozen=True)
class ModelSection:
    """Which model to train.

    Attributes:
        preset: an mpo preset (mpo.models.config.PRESETS) used when no checkpoint is given.
        hf_dir: a Hugging Face checkpoint; its config.json defines the architecture, its tokenizer encodes text tasks,
            and engines load it; the trainer starts from its weights (see mcore_dir).
        tokenizer_dir: where the tokenizer lives when not in hf_dir (default: hf_dir).
        mcore_dir: a torch_dist checkpoint to start from: a converted HF checkpoint or a trainer checkpoint's
            step directory. Unset with hf_dir set: `mpo train` converts hf_dir once into convert_dir and starts from
            it (mpo.model_import); unset without hf_dir: the preset's seeded random init.
        convert_dir: where `mpo train` keeps hf_dir's conversion (default: <logging.out_dir>/hf_converted); reused
            while hf_dir's files are unchanged.
        random_init: train hf_dir's architecture from seeded random weights (a from-scratch run); without it an
            hf_dir run always starts from hf_dir's weights.
        dtype: "fp32" or "bf16" for the transformer body.
        fp32_lm_head: keep the LM head and everything after it in fp32 (engines get the matching flag).
        recompute: full activation recompute of every layer.
    """

    preset: str = "tiny"
    hf_dir: str | None = None
    tokenizer_dir: str | None = None
    mcore_dir: str | None = None
    convert_dir: str | None = None
    random_init: bool = False
    dtype: Literal["fp32", "bf16"] = "fp32"
    fp32_lm_head: bool = True
    recompute: bool = False


@dataclass(frozen=True)
class RolloutSection:
    """Rollout engines and sampling.

    Attributes:
        engine: "mpo" (mpo's own engine, CPU default) or "sglang" (real SGLang servers).
        urls: engines to use; empty means the launcher starts `num_engines` local engines.
        num_engines: engines to start when urls is empty.
        samples_per_prompt: G, responses per prompt (the advantage group).
        max_new_tokens: response budget.
        temperature: sampling temperature (1.0 keeps engine log-probs comparable to the trainer's).
        top_p: nucleus mass.
        prompts_per_call: prompt groups per /generate call (a prompt's samples_per_prompt responses always go
            together): small calls stream, so a failed call re-sends only its own samples and rewards are scored as
            calls finish, while the others still generate. Never more than an engine's even share of the step
            (so every engine gets work). null: each engine's whole share in one call (fastest for one CPU engine,
            no streaming). Calls are consecutive groups in draw order, and mpo's engine decodes each call as its
            own batch: rollouts stay a pure function of (weights, seeds), whatever the timing.
        max_inflight_per_engine: calls in flight per engine at most (the next ones wait in the client's queue).
        api_key: sent as a bearer token to every engine. Unset: engines the run starts itself get a random key.
        request_timeout_s: the base of each /generate call's timeout, which adds the call's token budget at 50
            tokens/s (mpo.rollout.protocol.call_timeout_s): a small call slower than about this is a hung engine,
            and a call of 16 x 32k tokens still has hours. An off-policy run's rollout process silent for this
            long counts as hung too (warned about before, then stopped in one line).
        router_in_front: engines sit behind an sglang-router (its PyPI build drops routed experts: R3 impossible).
        engine_dtype: dtype of locally started engines (None: model.dtype). A bf16 engine for an fp32 trainer is
            the usual train/inference mismatch that R3 and RSPO exist for.
        engine_weights: the parameter format the weight sync pushes: "bf16" (every weight as the trainer holds it)
            or "fp8_block", for engines serving a block-FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8 style;
            mpo.weight_sync.fp8 says what is quantized), about half the bytes of bf16. The mismatch it adds shows in
            sync_fp8_weight_rel_rmse and the train-vs-rollout log-prob metrics.
        tensor_parallel: GPUs per SGLang engine (its --tp); the launcher (launch/) places gpus_per_node //
            tensor_parallel engines on each rollout node.
        colocate: the engines share the trainer's GPUs: they release their memory while the trainer runs and resume
            it for the weight sync and generation (SGLang needs --enable-memory-saver; schedule.mode=sync only).
        offload_trainer: with colocated engines, every trainer rank's device memory goes to the host while the
            engines generate (mpo.trainer.offload). None: on when colocate is; false keeps the trainer resident
            (when both fit, it saves the host copies' time every step).
        env: multi-turn episodes (mpo.envs has the protocol): a registered environment (calculator) or a plug-in
            "module:Class" or "path/to/file.py:Class" (mpo.plugins) built from each data row. The environment
            scores: reward.fn must be unset; its workers use reward.timeout_s (per call), reward.workers and
            reward.max_memory_mb. Text tasks with a chat template.
        max_turns: assistant turns per episode at most (rollout.env).
        max_tokens_per_turn: generation budget of one turn (rollout.env); null: rollout.max_new_tokens.
        max_env_state_bytes: cap on an environment's pickled state (rollout.env; mpo.envs says why): a state over
            it ends its episode as an error (reward 0, counted in env_errors).
    """

    engine: Literal["mpo", "sglang"] = "mpo"
    urls: tuple[str, ...] = ()
    num_engines: int = 1
    samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    prompts_per_call: int | None = 1
    max_inflight_per_engine: int = 16
    api_key: str | None = None
    request_timeout_s: float = 300.0
    router_in_front: bool = False
    engine_dtype: Literal["fp32", "bf16"] | None = None
    engine_weights: Literal["bf16", "fp8_block"] = "bf16"
    tensor_parallel: int = 1
    env: str | None = None
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_env_state_bytes: int = 1 << 20
    colocate: bool = False
    offload_trainer: bool | None = None

    @property
    def turn_new_tokens(self) -> int:
        """One environment turn's generation budget: max_tokens_per_turn, else max_new_tokens."""
        return self.max_tokens_per_turn or self.max_new_tokens


@dataclass(frozen=True)
class SyncSection:
    """The weight sync after each step: the trainer's weights streamed to the engines (mpo.weight_sync).

    Attributes:
        transport: how buckets reach the engines (one sender per pipeline stage; mpo.weight_sync.transports):
            "tensor" (HTTP payload; SGLang engines must be on the trainer's node), "distributed" (a process group
            between each stage's sender and the engines: NCCL on GPU, gloo on CPU; engines on other nodes),
            "cuda_ipc" (SGLang engines on the trainer's own GPUs map the buckets through CUDA IPC handles; GPU only)
            or "shm" (mpo engines on the trainer's host read the buckets in place from shared memory; CPU).
            "auto": "shm" for mpo engines the run starts itself on CPU (unless host_shared_memory is false), else
            "tensor" (resolve_transport). A user's transport class: "module:attr" or "path/to/file.py:attr" (a
            mpo.weight_sync.transports.Transport subclass; docs/extending.md). Checked against the registry.
        bucket_mb: bucket size.
        master_address: the address engines reach trainer rank 0 at for transport="distributed" (it hosts the
            weight-update group's rendezvous). None: 127.0.0.1 (engines on the trainer's machine); the launcher
            sets trainer node 0's host.
        host_shared_memory: on CPU, trainer ranks on one host pass their pieces of a bucket through shared-memory
            slots in /dev/shm (MPO_SHM_DIR) instead of gloo's loopback TCP (mpo.weight_sync.gather). None: on when
            training on CPU; false for a container with a tiny /dev/shm. Not available on GPU (NCCL moves pieces).
        probe_max_sequences: SGLang verification: the probe grows (64-token sequences) until the engine routes some
            token to every (MoE layer, expert), up to this many sequences; pairs still uncovered then are not
            verified, and the run says so in a warning (a trained model may have experts its router never picks).
    """

    transport: str = "auto"
    bucket_mb: int = 64
    master_address: str | None = None
    host_shared_memory: bool | None = None
    probe_max_sequences: int = 64

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb << 20


@dataclass(frozen=True)
class AlgorithmSection:
    """The RL algorithm.

    Attributes:
        loss: a registered policy loss (mpo.algorithms.loss_names()): gspo, sapo, rspo, grpo, dapo, ...
        loss_args: overrides of that loss's hyper-parameters (e.g. {eps_high: 0.28}).
        advantage: per-response grpo | drgrpo | rloo | batchstd | maxrl, per-token reinforce_pp |
            reinforce_pp_baseline (whitened over the step's whole batch), reinforce_ema (running-mean baseline,
            kept in checkpoints), or gae / vapo (with a critic; whitened over the global batch).
        advantage_args: the estimator's parameters (reinforce_pp: {gamma}; reinforce_ema: {beta}; gae: {gamma,
            lam}; vapo: {gamma, alpha, lam_value}; eps of the group estimators).
        kl_coef: weight of the KL penalty against the initial (reference) policy; 0 disables it.
        kl_estimator: k1 | k2 | k3 | k3_unbiased (k3 times pi/pi_old, TRL's bias-corrected KL).
        rollout_correction: none | tis_token | tis_seq | icepop_token | mis_seq | decoupled_token | decoupled_seq:
            importance weights / masks for the engine-vs-trainer log-prob mismatch (the mismatch metrics are logged
            every step either way). null (the default): none in schedule.mode=sync, tis_token in one_step_off and
            async (mpo.algorithms.rollout_correction.OFF_POLICY_DEFAULT says why); an explicit none there is an error.
        rollout_correction_args: its bounds ({cap}, {lower, upper}); unset ones take the kind's defaults.
        positive_nll_coef: VAPO's positive-example LM loss weight (0 disables it); positive_nll_threshold is the
            reward at which a response counts as positive.
        critic_lr / value_clip / critic_warmup_steps: the critic of gae / vapo (a value model at the policy's
            layout, initialised from it): its Adam learning rate, the value-loss clip c, and the first RL steps that
            train only the critic (VAPO's value pre-training).
        replay: routing replay: "none", "r2" (old-forward routes replayed in updates) or "r3" (engine routes
            replayed in the old forward and the updates). null (the default): none in schedule.mode=sync; r3 in
            one_step_off and async (r2 behind rollout.router_in_front, which drops the engines' routes): a stale
            sample replays the routes it was generated with, so a router that moved since cannot swing its
            log-probs (issue #25: without replay the demo's off-policy runs collapsed late, with it they learn).
        filter_zero_variance: drop prompt groups whose rewards are all equal (DAPO dynamic sampling).
        dynamic_sampling: DAPO's dynamic sampling: after the step's first draw, keep drawing prompt groups (more
            rounds, each with its own prompts and sampling seeds) until data.prompts_per_step groups have non-zero
            reward variance, then train on exactly those (advantages computed over them; zero-variance groups are
            never trained on, whatever filter_zero_variance says). Every drawn group moves the data position and
            is seen by prompt retirement. Logged: sampling_rounds, sampling_groups_drawn, sampling_exhausted (1 when
            max_sampling_rounds ran out first: the step trains on the groups it found, kept_samples_frac < 1).
            Needs rollout.samples_per_prompt >= 2.
        max_sampling_rounds: the most draws (the first included) one step may take under dynamic_sampling; the
            DAPO recipe's max_num_gen_batches is 10.
        overlong_filter: DAPO overlong filtering: truncated responses (no EOS within the budget) get no loss.
        overlong_buffer: DAPO soft overlong punishment's L_cache in tokens (0: off): a response longer than
            data.max_response_tokens - overlong_buffer gets a penalty growing linearly to -1 (DAPO).
    """

    loss: str = "gspo"
    loss_args: dict = field(default_factory=dict)
    advantage: str = "grpo"
    advantage_args: dict = field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    rollout_correction: str | None = None
    rollout_correction_args: dict = field(default_factory=dict)
    positive_nll_coef: float = 0.0
    positive_nll_threshold: float = 1.0
    critic_lr: float = 1e-3
    value_clip: float = 0.5
    critic_warmup_steps: int = 0
    replay: Literal["none", "r2", "r3"] | None = None
    filter_zero_variance: bool = True
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 10
    overlong_filter: bool = False
    overlong_buffer: int = 0


@dataclass(frozen=True)
class DataSection:
    """Prompts.

    Attributes:
        task: "toy:reverse" / "toy:add" (built-in verifiable digit tasks in token space); a .jsonl or .parquet
            file, a directory or a glob of them, rows {"prompt": str | "messages": [chat], "answer": ...} (other keys
            are metadata); or "reasoning_gym:<task>[?size=N&seed=S]". Text tasks need model.hf_dir (or
            model.tokenizer_dir) for the tokenizer; files are read lazily in a seeded order whose position is
            checkpointed.
        prompt_key / answer_key: the column names of the prompt and the answer in data files.
        chat_template: wrap prompts in the tokenizer's chat template (None: when the tokenizer has one).
        system_prompt: a system message put first (chat template only).
        max_prompt_tokens: longer prompts are dropped (and counted: data_dropped_long_prompts). Unset (and never
            above): the model's context length minus rollout.max_new_tokens, what an engine accepts.
        max_row_bytes: jsonl lines longer than this are skipped when the file is indexed (counted and logged).
        max_response_tokens: DAPO's L_max for overlong shaping (default: rollout.max_new_tokens).
        samples_logged: responses per step written to samples.jsonl (text tasks) next to metrics.jsonl.
        prompts_per_step: prompts sampled per RL step (each gets samples_per_prompt responses).
        digits: toy task size (digits per operand).
        retire_pass_rate: no-positive-resampling (ScaleRL): a prompt whose responses pass (reward 1) at this rate
            or more is never sampled again (the retired set is checkpointed); None keeps every prompt. ScaleRL: 0.9.
    """

    task: str = "toy:reverse"
    prompts_per_step: int = 8
    digits: int = 3
    retire_pass_rate: float | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat_template: bool | None = None
    system_prompt: str | None = None
    max_prompt_tokens: int | None = None
    max_row_bytes: int = 16 << 20
    max_response_tokens: int | None = None
    samples_logged: int = 4


@dataclass(frozen=True)
class RewardSection:
    """How responses are scored (text tasks; the toy tasks score token ids with their own partial-credit reward).

    Attributes:
        fn: a registered reward (mpo.rewards: math, reasoning_gym, toy) or a plug-in "module:function" or
            "path/to/file.py:function" (mpo.plugins) with the signature (completion: str, answer, metadata: dict) ->
            float. None: the task's own (reasoning_gym tasks use their scorer, files use math).
        timeout_s: a verifier slower than this gives 0 and counts in reward_errors (the worker is replaced);
            math-verify bounds its own parse and verify at 5 s each, so keep this above 10.
        workers: processes scoring in parallel.
        max_memory_mb: memory cap of each worker and what it starts (RLIMIT_DATA): an allocation past it fails in
            the reward, which scores 0 and counts in reward_errors; null: no cap.
    """

    fn: str | None = None
    timeout_s: float = 20.0
    workers: int = 2
    max_memory_mb: int | None = 4096


@dataclass(frozen=True)
class ScheduleSection:
    """Optimisation schedule.

    Attributes:
        steps: RL steps. Raising it for a resumed (or finished) run re-shapes a decaying lr schedule, which spans
            `steps`: the resume says so in one warning line (the lr at the resumed step before and after).
        updates_per_step: optimizer steps (mini-batches) per RL step.
        micro_batch_size: rows per forward/backward (with packing: at most this many sequences per micro-batch).
        max_tokens_per_microbatch: sequence packing (mpo.trainer.packing): every pass packs its samples end to end
            into micro-batches of at most this many tokens (no padding between sequences; DP shares balanced by
            token count); null: off, each micro-batch is micro_batch_size right-padded rows.
        forward_micro_batch_size: rows per forward of the old-logprob pass (verl's log_prob_micro_batch_size):
            consecutive right-padded micro-batches are joined up to this many rows, so the fixed cost of a forward
            is paid once per group (each row's log-probs are its own micro-batch's, to float rounding: a GEMM over
            more rows may add in another order, <= 5e-7 measured). The memory plan counts it as a training
            micro-batch of that size (an upper bound: the pass keeps no activations). null: micro_batch_size. Unused
            with packing (its micro-batches are sized by tokens) and under pipeline parallelism (megatron's stage
            buffers take one shape per pass).
        lr: Adam learning rate (the peak, after warmup).
        clip_grad: gradient-norm clip.
        lr_warmup_steps: RL steps of linear warmup from 0 to lr (0: none); below `steps` (mpo.trainer.lr_schedule).
        lr_decay: after warmup, "constant", "linear" / "cosine" decay to min_lr over the remaining steps, or "wsd"
            (warmup-stable-decay, megatron's WSD): lr held, then a linear decay to min_lr over the last
            lr_wsd_decay_frac of the steps after warmup.
        lr_wsd_decay_frac: the share of the post-warmup steps in wsd's final decay, in (0, 1] (a share, not a step
            count, so `mpo demo --steps N` keeps the schedule's shape).
        min_lr: the decay's floor (<= lr).
        weight_decay: Adam's decoupled weight decay on matrices (biases and norms are exempt).
        adam_beta1 / adam_beta2 / adam_eps: Adam's moments and epsilon.
        sft_steps: supervised warm-start steps before RL (toy tasks).
        sft_lr: warm-start learning rate.
        max_nonfinite_steps: stop (with a checkpoint) after this many non-finite steps in a row.
        mode: when rollouts are generated (mpo.trainer.schedule): "sync" (generate, train, sync), "one_step_off"
            (step n+1's rollouts are generated while step n trains; weights reach the engines between batches) or
            "async" (a producer keeps the engines busy; weight updates reach them in flight; per-token versions).
        max_staleness: async: a consumed token is at most this many policy versions older than the step training
            on it (one_step_off is async with 1, updates between batches).
    """

    steps: int = 20
    updates_per_step: int = 1
    micro_batch_size: int = 16
    max_tokens_per_microbatch: int | None = None
    forward_micro_batch_size: int | None = None
    lr: float = 1e-3
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay: Literal["constant", "linear", "cosine", "wsd"] = "constant"
    lr_wsd_decay_frac: float = 0.0
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sft_steps: int = 0
    sft_lr: float = 3e-3
    max_nonfinite_steps: int = 3
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = 1


@dataclass(frozen=True)
class EvalSection:
    """Evaluation on held-out prompts during training (mpo.trainer.evaluation), through the run's engines right
    after a weight sync, scored by the run's reward.

    Attributes:
        every: evaluate the policy before RL steps 0, every, 2*every, ... and after the last step (0: off).
        task: any data.task form (a jsonl/parquet file, directory or glob, reasoning_gym:<task>, a toy task); null:
            data.task (held out by seed for the toy tasks; for files point this at a held-out file).
        prompts: held-out prompts, drawn once in a seeded order (the same ones at every evaluation).
        samples_per_prompt: k: responses per prompt; logged as eval/mean@k and eval/pass@k (reward 1.0 = pass).
        temperature: sampling temperature of the evaluation (0: greedy).
        max_new_tokens: generation budget (null: rollout.max_new_tokens).
    """

    every: int = 0
    task: str | None = None
    prompts: int = 64
    samples_per_prompt: int = 4
    temperature: float = 1.0
    max_new_tokens: int | None = None


@dataclass(frozen=True)
class LoggingSection:
    """Outputs.

    Attributes:
        out_dir: run directory: metrics.jsonl, TensorBoard events, checkpoints, logs.
        tensorboard: also write TensorBoard events (if the tensorboard package is installed).
        checkpoint_every: steps between checkpoints (0: only at the end). Non-zero also checkpoints the end of the
            supervised warm start (step_0), so a crash early in RL does not repeat it.
        keep_checkpoints: complete checkpoints kept in out_dir/checkpoints (>= 1): once a newer one is committed the
            oldest beyond this many are deleted. Each is a trainer checkpoint (weights, optimizer state, the HF config
            and tokenizer files); `mpo export RUN --step N` turns one into an HF folder.
        checkpoint_async: write checkpoints in a background process (megatron's async torch_dist save) while
            training goes on; null means on with CUDA, off on CPU. The run's last checkpoint is always waited for.
        checkpoint_format: how the distributed optimizer's state (Adam moments, fp32 master weights) is stored.
            "dp_reshardable" (default): each data-parallel rank writes its own shard of the flat buffers, nothing is
            gathered to one rank; such a checkpoint resumes only at the layout it was saved at. "fully_reshardable":
            the state is mapped onto the parameters' global tensors (gathered over data parallelism to DP rank 0 in
            host memory on save), loadable at any TP/PP/EP/DP layout. The run's last checkpoint (the export) is
            always fully_reshardable. The plain optimizer's state is per model shard and reshardable either way.
        progress: show a progress bar on rank 0.
        print_every: rank 0 logs a one-line summary of every N-th RL step (step, reward, exact answers, loss, lr, step
            time, tokens/s, held-out metrics when evaluated), the run's first and last step too, and a line every N
            warm-start steps; 0: none. null (default): 1 without the progress bar (a long run on a cluster shows
            each step in its log), 0 with it (warm-start lines every 10 steps).
        wandb: also log every metrics row to Weights & Biases (rank 0; needs `pip install 'mpo[wandb]'`). The run's
            files go under out_dir/wandb; WANDB_MODE=offline (or WANDB_MODE=disabled) works without a network.
        wandb_project / wandb_run_name: the W&B project and run name (None: W&B's generated name).
        phase_times: log each step's wall time per phase as `time/<phase>_s` (prompt draw, request build, engine,
            HTTP, scoring, broadcast, micro-batch build, old-logprob pass, each update, sync, metrics, checkpoint;
            mpo.trainer.phases). Off by default; `python -m mpo.bench step_profile` turns it on.
        versions_per_token: write every consumed token's policy version to versions.jsonl (a debugging aid: ~200 MB
            of JSON a step at 55M tokens). Off: one summary per sample (tokens, min and max version, and how often the
            version changes inside the response).
    """

    out_dir: str = "runs/mpo"
    tensorboard: bool = True
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    checkpoint_async: bool | None = None
    checkpoint_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    progress: bool = True
    print_every: int | None = None
    wandb: bool = False
    wandb_project: str = "mpo"
    wandb_run_name: str | None = None
    phase_times: bool = False
    versions_per_token: bool = False


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. See each section's docstring."""

    model: ModelSection = ModelSection()
    parallel: ParallelConfig = ParallelConfig()
    rollout: RolloutSection = RolloutSection()
    sync: SyncSection = SyncSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    data: DataSection = DataSection()
    reward: RewardSection = RewardSection()
    schedule: ScheduleSection = ScheduleSection()
    eval: EvalSection = EvalSection()
    logging: LoggingSection = LoggingSection()
    seed: int = 1234
    world_size: int = 1

    @property
    def engine_dtype(self) -> str:
        return served_dtype(self.model, self.rollout)

    @property
    def response_tokens(self) -> int:
        """DAPO's L_max, the response length overlong shaping measures against: data.max_response_tokens, else
        rollout.max_new_tokens."""
        return self.data.max_response_tokens or self.rollout.max_new_tokens

    @property
    def eval_new_tokens(self) -> int:
        """A held-out response's generation budget: eval.max_new_tokens, else rollout.max_new_tokens."""
        return self.eval.max_new_tokens or self.rollout.max_new_tokens


def served_dtype(model: ModelSection, rollout: RolloutSection) -> str:
    """The dtype the engines serve (TrainConfig.engine_dtype): rollout.engine_dtype, else model.dtype."""
    return rollout.engine_dtype or model.dtype


# -- loading ---------------------------------------------------------------------------------------------------------
# Values quoted in errors are bounded: a config value may be huge (a long string, or a YAML alias bomb whose repr was
# 312 MB in one "one-line" error), and reprlib stops at these sizes without building the whole repr first.
_QUOTE = reprlib.Repr(maxlevel=3, maxtuple=6, maxlist=6, maxarray=6, maxdict=6, maxset=6, maxfrozenset=6,
                      maxdeque=6, maxstring=120, maxlong=40, maxother=120)
QUOTE_CHARS = 200
# Nodes a YAML document may expand to through its aliases (a real config has a few hundred): nine aliases of nine
# aliases, eight levels deep, are 900 bytes of YAML and 43 million values.
YAML_MAX_NODES = 100_000


def _show(value: Any) -> str:
    """repr(value) for an error message, at most QUOTE_CHARS characters."""
    text = _QUOTE.repr(value)
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


def _yaml_load(text: str) -> Any:
    """yaml.safe_load, refusing documents whose aliases expand past YAML_MAX_NODES nodes (or into themselves): the
    node graph is measured, counting each alias as a copy, before any Python object is built."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_nodes(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_nodes(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes `node` stands for with every alias expanded; ValueError past YAML_MAX_NODES or for a node inside
    itself. Shared nodes are measured once (sizes), so this costs the graph's size, not the expansion's."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ValueError("a YAML alias refers to a node that contains it (recursive alias)")
    open_nodes.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [item for pair in node.value for item in pair]
    else:
        children = []
    for child in children:
        total += _expanded_nodes(child, sizes, open_nodes)
        if total > YAML_MAX_NODES:
            raise ValueError(f"YAML aliases expand to more than {YAML_MAX_NODES:,} values (an alias bomb?)")
    open_nodes.discard(key)
    sizes[key] = total
    return total


def _coerce(value: Any, annotation: Any, name: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if is_dataclass(annotation):
        return _build(annotation, value, name)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{name}={_show(value)}; valid values: {', '.join(map(repr, args))}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # X | None: X's own message (a Literal's valid values, say)
            return _coerce(value, options[0], name)
        for arg in options:
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name}={_show(value)} has the wrong type (expected {annotation})")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_coerce(v, args[0], name) for v in value)
    if annotation is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={_show(value)}: expected true or false")
        return value
    if annotation in (int, float):
        try:
            if isinstance(value, bool) or (annotation is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return annotation(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={_show(value)}: expected {annotation.__name__}") from None
    if annotation is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{name}={_show(value)}: expected a string")
        return str(value)
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={_show(value)}: expected a mapping")
        return dict(value)
    return value


MOVED = {"rollout.sync": "sync.transport", "rollout.bucket_mb": "sync.bucket_mb",  # old name: fails naming the new
         "rollout.sync_master_address": "sync.master_address", "rollout.host_shared_memory": "sync.host_shared_memory"}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of fields, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        where = f"{prefix}." if prefix else ""
        if f"{where}{unknown[0]}" in MOVED:
            raise ConfigError(f"{where}{unknown[0]} moved to {MOVED[where + unknown[0]]}")
        raise ConfigError(f"unknown field {where}{unknown[0]}; valid fields{' of ' + prefix if prefix else ''}: "
                          f"{', '.join(sorted(known))}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except LayoutError as exc:  # a bad parallel field: one line (the CLIs print ConfigError without a traceback)
        raise ConfigError(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def _parse_scalar(item: str, text: str) -> Any:
    try:
        return _yaml_load(text) if text else ""
    except yaml.YAMLError as exc:
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"override {_show(item)}: the value is not valid YAML ({reason}); quote strings, close "
                          f"brackets") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"override {_show(item)}: {exc}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.field=value` strings (values parsed as YAML scalars/lists) to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {_show(item)}: expected section.field=value")
        path, raw = item.split("=", 1)
        node = data
        parts = path.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {_show(item)}: {part} is not a section")
        node[parts[-1]] = _parse_scalar(item, raw)
    return data


def read_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read YAML (optional), apply overrides and build the config: the data alone, each field coerced but nothing
    checked across fields (mpo.config_checks.load_config, the loader every entry point uses, resolves and checks)."""
    data = _read_yaml(Path(path)) if path is not None else {}
    return _build(TrainConfig, apply_overrides(data, list(overrides)), "")


def resolve_replay(mode: str, router_in_front: bool) -> str:
    """algorithm.replay as a run uses it when unset: none on-policy; off-policy the routes a sample was generated with
    (r3), or the old forward's (r2) where a router in front of the engines drops them."""
    return "none" if mode == "sync" else "r2" if router_in_front else "r3"


def _read_yaml(path: Path) -> dict:
    """A config file's top-level mapping; unreadable, non-UTF-8, invalid, empty or non-mapping files fail in one
    line."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start]:#04x})"
                          ) from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path}:{where}: invalid YAML: {reason}") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply") from None
    except ValueError as exc:  # _yaml_load's bound
        raise ConfigError(f"config file {path}: {exc}") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty; expected sections such as model:, rollout:, algorithm:")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)
