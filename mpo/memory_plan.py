"""GPU memory plan of a run: per GPU role, the bytes of parameters, gradients, optimizer state and activations
(trainer ranks: the policy and, for PPO/VAPO, the critic) and of weights and KV cache (rollout engines).

`mpo plan --config FILE [--gpu-mem-gib 79.6]` prints it and exits non-zero when a role does not fit; `mpo check-config`
runs it for configs whose engines are SGLang (GPU runs). For the others, check-config, `mpo train` and `mpo demo`
compare lower bounds of the model state with this machine's memory (check_fits_here) before any rank builds a model.

Parameters are counted from the layer shapes and megatron's sharding rules (`StageParams`, one dataclass per pipeline
stage): attention and dense/shared MLPs split by TP, routed experts by EP x expert-TP, the embedding on the first stage,
final norm and LM head on the last, norms and routers replicated; stages hold the layers `ParallelConfig.stage_layers`
places there (uneven and virtual stages included). tests/test_memory_plan.py compares these bytes with the tensors a
real megatron model, its DDP grad buffers and its optimizer allocate at TP2 x EP2 x PP2, with and without the
distributed optimizer.

Bytes per parameter element (megatron mixed precision, grads reduced in fp32 as mpo's DDP does):
  params: 2 (bf16) or 4 (fp32; the fp32 LM head is always 4);
  grads: 4 (the fp32 grad buffer);
  optimizer: Adam m and v, 8, plus a 4-byte fp32 master copy of every bf16 parameter; with the distributed optimizer
  all of it is divided by the data-parallel size (expert parameters: the expert-data-parallel size), as megatron's
  DistributedOptimizer shards it. The buffers' 64-element alignment padding is ignored (< 0.1% at scale).

Activations (bytes of one micro-batch on one rank; s tokens, b rows, h hidden, t = TP with sequence parallelism): per
transformer layer without recompute, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2 and section 4.1, sequence parallel): 2 bytes x s b / t x (the inputs each layer keeps for
backward), here with flash/fused attention (no s^2 terms, as TE on GPU) and no dropout masks:
  attention: h (QKV input) + (heads + 2 kv_groups) x head_dim (Q, K, V) + heads x v_head_dim (proj input) + h (norm);
  MoE MLP: h (norm) + h (router input) + top_k x (h + 3 x moe_ffn / expert-TP) (dispatched tokens, fc1 output, fc2
  input), plus 4 x shared_ffn (shared expert) or 4 x ffn for a dense MLP layer.
With full recompute (model.recompute: megatron's uniform method, one layer per group) a layer keeps only its input,
2 s b h / t bytes, and one layer's activations are live while it is recomputed. A pipeline stage keeps the
activations of the micro-batches in flight: PP - rank under 1F1B; under the interleaved schedule megatron's warm-up
count 2 (PP - rank - 1) + (vpp - 1) PP + 1 chunk-micro-batches. The last stage's head runs fused with the log-probs
(mpo.models.fused_head): it keeps the head's fp32 input (4 s b h), three fp32 floats per token, one chunk's
working set (4 fp32 buffers of CHUNK_ELEMENTS) and the backward's fp32 weight-gradient sum (4 V h / t), never the
[s b, V / t] logits (those would be 2 x 4 x s b V / t: ~40 GB at 33k tokens and Qwen3's vocabulary). With sequence
packing (schedule.max_tokens_per_microbatch) a micro-batch is one row of the token budget (s b = the budget; a sample
longer than it runs alone). Context parallelism (parallel.context_parallel) divides every per-token term by CP: each CP
rank holds 2 of 2 x CP chunks of each row (Transformer Engine's ring attention passes K/V blocks; the local spec's
all-gathered K/V, a CPU proof, is not planned). A fixed reserve covers the CUDA context, NCCL buffers and allocator
fragmentation.

Routing bookkeeping (mpo.routing.capture; per rank of a stage with L MoE layers, top-K, the rank's DP share of a step's
rows x seq_len tokens T; the records and engine routes live in (pinned) host memory between uses and move to the GPU one
micro-batch at a time, so the plan puts only the replay indices on the device and states the host bytes;
one update's share T / updates_per_step, e = 1 byte per expert id up to 256 experts, else 2):
  the old-logprob pass's records, kept for the step: T L K e (chosen experts), x 2 under replay (r2/r3: the router's
  natural choice too), + 4 T L K (fp32 router log-probs) only when the loss reads them (RSPO / +rs);
  R3: the engine's routes for the step, 2 T L K (int16, -1 where there is no record);
  one update pass's records: the same index bytes for T / updates_per_step tokens, + 8 per (log-probs at the chosen
  and at the old experts) for RSPO;
  replay (r2/r3): int64 replay indices, 8 x (micro-batch tokens) L K per micro-batch in flight (the routing call's,
  kept by autograd until that micro-batch's backward; never cached for the whole pass).

Engines (SGLang): bf16 weights of the whole model divided by the engine's TP; SGLang reserves mem_fraction of the GPU
for weights plus KV cache, so the KV cache is what remains of that share; it must hold at least one full sequence.
KV bytes per token: layers x 2 x kv_groups x head_dim x 2 / TP (GQA) or layers x (kv_lora_rank + rope_dim) x 2 (MLA's
latent cache, replicated over TP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from mpo.models.builder import padded_vocab_size
from mpo.models.config import MoEModelConfig
from mpo.parallel.config import ParallelConfig

GIB = 2**30
H100_GIB = 79.6  # an "80 GB" H100 as nvidia-smi counts it: 81,559 MiB
TIGHT_FRACTION = 0.05  # a role with less free than this share of its GPU is flagged
RESERVE_BYTES = 4 * GIB  # CUDA context, NCCL communicators and buffers, allocator fragmentation


@dataclass(frozen=True)
class StageParams:
    """Parameter elements one rank of a pipeline stage holds.

    Attributes:
        dense: everything replicated over the data-parallel ranks (attention, dense and shared MLPs, norms, routers,
            embedding), in the body's dtype.
        expert: routed experts (sharded over EP x expert-TP), replicated over the expert-data-parallel ranks.
        head: the LM head (or a critic's value head), kept in fp32 with fp32_lm_head.
    """

    dense: int = 0
    expert: int = 0
    head: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert + self.head


def _attention(m: MoEModelConfig, tp: int) -> tuple[int, int]:
    """(TP-split elements, replicated elements) of one attention block with its input norm."""
    h = m.hidden_size
    if m.multi_latent_attention:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        split = m.num_attention_heads * m.v_head_dim * h  # linear_proj
        split += m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank  # linear_kv_up_proj
        # down projections: TE's duplicated linears on GPU (a full copy on every TP rank)
        replicated = h + (m.kv_lora_rank + m.qk_rope_head_dim) * h + m.kv_lora_rank  # norm, kv_down, kv norm
        if m.q_lora_rank:
            split += m.num_attention_heads * qk * m.q_lora_rank  # linear_q_up_proj
            replicated += m.q_lora_rank * h + m.q_lora_rank  # q_down, q norm
        else:
            split += m.num_attention_heads * qk * h  # linear_q_proj
        return split // tp, replicated
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim * (h + int(m.attention_bias))  # + biases
    proj = m.num_attention_heads * m.head_dim * h
    norms = h + (2 * m.head_dim if m.qk_layernorm else 0)
    return (qkv + proj) // tp, norms


def _layer(m: MoEModelConfig, layer: int, parallel: ParallelConfig) -> StageParams:
    """Elements of global layer `layer` (0-based) on one rank."""
    tp, h = parallel.tensor_parallel, m.hidden_size
    split, replicated = _attention(m, tp)
    replicated += h  # pre-MLP norm
    if layer < m.first_k_dense:
        return StageParams(dense=split + 3 * m.ffn_hidden_size * h // tp + replicated)
    experts = m.num_experts // parallel.expert_parallel * 3 * m.moe_ffn_hidden_size * h // parallel.etp
    replicated += m.num_experts * h  # router
    if m.moe_shared_expert_intermediate_size:
        split += 3 * m.moe_shared_expert_intermediate_size * h // tp
    return StageParams(dense=split + replicated, expert=experts)


def stage_params(m: MoEModelConfig, parallel: ParallelConfig, pp_rank: int, *, value_head: bool = False
                 ) -> StageParams:
    """Elements on one rank of pipeline stage `pp_rank` (all its virtual chunks); `value_head`: a critic (the LM
    head replaced by hidden -> 1 with a bias)."""
    parts = [_layer(m, i, parallel) for chunk in parallel.stage_layers(m.num_layers)[pp_rank] for i in chunk]
    dense, expert, head = sum(part.dense for part in parts), sum(part.expert for part in parts), 0
    vocab = padded_vocab_size(m.vocab_size, parallel.tensor_parallel) * m.hidden_size // parallel.tensor_parallel
    last = pp_rank == parallel.pipeline_parallel - 1
    if pp_rank == 0:
        dense += vocab
    if last:
        dense += m.hidden_size  # final norm
        if value_head:
            head = m.hidden_size + 1
        elif not (m.tie_word_embeddings and parallel.pipeline_parallel == 1):
            head = vocab  # megatron keeps a copy of a tied embedding on the last stage when PP > 1
    return StageParams(dense, expert, head)


@dataclass(frozen=True)
class ModelMemory:
    """Bytes one rank spends on one model (the policy or the critic): weights, fp32 grads, optimizer state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_memory(p: StageParams, *, bf16: bool, fp32_head: bool, data_parallel: int, expert_data_parallel: int,
                 distributed_optimizer: bool) -> ModelMemory:
    """See the module docstring for the bytes per element."""
    body = p.dense + p.expert
    head_bytes = 4 if (fp32_head or not bf16) else 2
    params = body * (2 if bf16 else 4) + p.head * head_bytes
    grads = 4 * p.total
    per_dense = 8 + (4 if bf16 else 0)  # Adam's m and v, and an fp32 master copy of every bf16 parameter
    per_head = 8 + (4 if head_bytes == 2 else 0)
    dp, edp = (data_parallel, expert_data_parallel) if distributed_optimizer else (1, 1)
    optimizer = p.dense * per_dense / dp + p.expert * per_dense / edp + p.head * per_head / dp
    return ModelMemory(params, grads, int(optimizer))


def activation_bytes(m: MoEModelConfig, parallel: ParallelConfig, pp_rank: int, *, seq_len: int,
                     micro_batch_size: int, num_microbatches: int, recompute: bool) -> int:
    """Peak activation bytes on one rank of stage `pp_rank` (formula and source: module docstring)."""
    t = parallel.tensor_parallel if parallel.use_sequence_parallel else 1
    cp = parallel.context_parallel  # each CP rank holds 2 of 2 x CP chunks of every row
    tokens = seq_len * micro_batch_size / (t * cp)
    h = m.hidden_size
    v_dim = m.v_head_dim if m.multi_latent_attention else m.head_dim
    kv = m.num_attention_heads if m.multi_latent_attention else m.num_query_groups
    attention = h + (m.num_attention_heads + 2 * kv) * m.head_dim + m.num_attention_heads * v_dim + h

    def layer_elements(layer: int) -> float:
        if layer < m.first_k_dense:
            mlp = h + 4 * m.ffn_hidden_size
        else:
            mlp = 2 * h + m.router_topk * (h + 3 * m.moe_ffn_hidden_size / parallel.etp)
            mlp += 4 * (m.moe_shared_expert_intermediate_size or 0)
        return attention + mlp

    layers = [i for chunk in parallel.stage_layers(m.num_layers)[pp_rank] for i in chunk]
    per_layer = [2 * tokens * layer_elements(i) for i in layers]
    kept = [2 * tokens * h] * len(layers) if recompute else per_layer
    pp, rank, vpp = parallel.pipeline_parallel, pp_rank, parallel.vpp
    if vpp > 1:  # chunk-micro-batches in flight, each holding one chunk's layers
        in_flight = min(num_microbatches * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1) / vpp
    else:
        in_flight = min(num_microbatches, pp - rank)
    total = sum(kept) * in_flight
    if recompute:
        total += max(per_layer, default=0)  # the layer being recomputed
    if rank == pp - 1:
        from mpo.models.logprobs import CHUNK_ELEMENTS

        vocab = padded_vocab_size(m.vocab_size, parallel.tensor_parallel) / parallel.tensor_parallel
        tokens_mb = seq_len * micro_batch_size / cp
        total += 4 * tokens_mb * h + 12 * tokens_mb + 4 * 4 * CHUNK_ELEMENTS + 4 * vocab * h
    return int(total)


def routing_parts(m: MoEModelConfig, parallel: ParallelConfig, pp_rank: int, *, step_tokens: int,
                  updates_per_step: int, microbatch_tokens: int, replay: str, router_logprobs: bool) -> dict[str, int]:
    """Routing records and replay indices on one rank of stage `pp_rank`, by part (formula: module docstring).
    `replay`: "none", "r2" or "r3"; `router_logprobs`: the loss reads router log-probs (RSPO / +rs)."""
    chunks = parallel.stage_layers(m.num_layers)[pp_rank]
    per_token = sum(1 for chunk in chunks for layer in chunk if layer >= m.first_k_dense) * m.router_topk
    e = 1 if m.num_experts <= 256 else 2
    replaying = replay in ("r2", "r3")
    index = e * (2 if replaying else 1)
    pp, rank = parallel.pipeline_parallel, pp_rank
    in_flight = pp - rank if parallel.vpp == 1 else 2 * (pp - rank - 1) + (parallel.vpp - 1) * pp + 1
    return {
        "old records": int(step_tokens * per_token * (index + (4 if router_logprobs else 0))),
        "engine routes": int(2 * step_tokens * per_token) if replay == "r3" else 0,
        "update records": int(step_tokens / max(updates_per_step, 1) * per_token
                              * (index + (8 if router_logprobs else 0))),
        "replay indices": int(8 * microbatch_tokens * per_token * in_flight) if replaying else 0,
    }


@dataclass(frozen=True)
class RoleMemory:
    """One GPU role's bytes, by item (printed in this order), and whether they fit."""

    role: str
    items: dict[str, int] = field(default_factory=dict)
    capacity: int = 0
    note: str = ""
    fills_capacity: bool = False  # an engine: its KV cache takes what its share leaves, by design (never "tight")

    @property
    def total(self) -> int:
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def tight(self) -> bool:
        """Fits, but with less than TIGHT_FRACTION of the GPU free: estimates are not exact, fragmentation grows."""
        return self.fits and not self.fills_capacity and self.capacity - self.total < TIGHT_FRACTION * self.capacity

    @property
    def verdict(self) -> str:
        free = (self.capacity - self.total) / GIB
        if not self.fits:
            return f"DOES NOT FIT ({-free:.1f} GiB over)"
        if self.tight:
            return f"TIGHT: fits with {free:.1f} GiB free, under {TIGHT_FRACTION:.0%}"
        return "fits" if self.fills_capacity else f"fits, {free:.1f} GiB free"


@dataclass(frozen=True)
class PlanInputs:
    """What the plan needs beyond the config.

    Attributes:
        gpu_mem_gib: memory of one GPU in GiB (2^30 bytes), as nvidia-smi's total / 1024: an "80 GB" H100 has
            79.6 (81,559 MiB), an H200 139.8.
        seq_len: tokens per training row; None: rollout.max_new_tokens + prompt_tokens.
        prompt_tokens: prompt budget when seq_len is None.
        engine_mem_fraction: SGLang --mem-fraction-static; None: 0.85 (disaggregated engines, SGLang's own choice
            on 80 GB GPUs is close to it).
    """

    gpu_mem_gib: float = H100_GIB
    seq_len: int | None = None
    prompt_tokens: int = 1024
    engine_mem_fraction: float | None = None


def plan_memory(config, inputs: PlanInputs = PlanInputs()) -> list[RoleMemory]:
    """Per GPU role (the heaviest trainer stage, each SGLang engine) the bytes it needs on `inputs.gpu_mem_gib`."""
    from mpo.algorithms.registry import get_loss
    from mpo.algorithms.step_advantages import AdvantageConfig
    from mpo.config_checks import model_config

    m = model_config(config)
    par, s, r = config.parallel, config.schedule, config.rollout
    capacity = int(inputs.gpu_mem_gib * GIB)
    seq = inputs.seq_len or r.max_new_tokens + inputs.prompt_tokens
    world = config.world_size
    dp = par.data_parallel(world)
    edp = world // (par.etp * par.expert_parallel * par.pipeline_parallel)
    # A GPU plan: an unset distributed_optimizer means on (megatron's default with CUDA).
    distributed = par.distributed_optimizer is not False
    bf16 = config.model.dtype == "bf16"
    critic = AdvantageConfig(config.algorithm.advantage, dict(config.algorithm.advantage_args)).needs_critic
    router_logprobs = get_loss(config.algorithm.loss).router_shift  # as the trainer's routing hooks
    rows = r.samples_per_prompt * config.data.prompts_per_step
    microbatches = max(1, -(-rows // (dp * config.schedule.updates_per_step * s.micro_batch_size)))
    # Activations scale with the tokens of one micro-batch: micro_batch_size rows of `seq` padded, or one packed row
    # of the token budget (a sample longer than the budget runs alone at its own length, at most `seq`).
    act_seq, act_rows, shape = seq, s.micro_batch_size, f"{seq} tokens x {s.micro_batch_size} rows"
    if s.max_tokens_per_microbatch:
        act_seq, act_rows = max(s.max_tokens_per_microbatch, seq), 1
        shape = f"packed, {act_seq} tokens per micro-batch"
        # one row of the budget per micro-batch; a sample longer than the budget is a micro-batch of its own
        microbatches = max(1, -(-rows * seq // (dp * config.schedule.updates_per_step * act_seq)))
    best: RoleMemory | None = None
    # megatron shards dense state over DP x CP
    sharded = dict(bf16=bf16, data_parallel=dp * par.context_parallel, expert_data_parallel=edp,
                   distributed_optimizer=distributed)
    for rank in range(par.pipeline_parallel):
        items: dict[str, int] = {}
        policy = model_memory(stage_params(m, par, rank), fp32_head=config.model.fp32_lm_head, **sharded)
        items.update({"policy params": policy.params, "policy grads": policy.grads,
                      "policy optimizer": policy.optimizer})
        if config.algorithm.kl_coef > 0:
            items["KL reference weights"] = policy.params
        if critic:
            value = model_memory(stage_params(m, par, rank, value_head=True), fp32_head=True, **sharded)
            items.update({"critic params": value.params, "critic grads": value.grads,
                          "critic optimizer": value.optimizer})
        items["activations"] = activation_bytes(m, par, rank, seq_len=act_seq, micro_batch_size=act_rows,
                                                num_microbatches=microbatches, recompute=config.model.recompute)
        if (s.forward_micro_batch_size and s.forward_micro_batch_size > act_rows and par.pipeline_parallel == 1
                and not s.max_tokens_per_microbatch):
            # the old-logprob pass's joined forwards, counted as one training micro-batch of that many rows (an upper
            # bound: a forward-only pass keeps no layer's activations)
            items["activations"] = max(items["activations"], activation_bytes(
                m, par, rank, seq_len=act_seq, micro_batch_size=s.forward_micro_batch_size, num_microbatches=1,
                recompute=config.model.recompute))
        routing = routing_parts(
            m, par, rank, step_tokens=-(-rows // dp) * seq, updates_per_step=s.updates_per_step,
            microbatch_tokens=act_seq * act_rows // par.context_parallel, replay=config.algorithm.replay or "none",
            router_logprobs=router_logprobs)
        # records and engine routes stay on the host between uses (mpo.routing.records.host_copy); the device holds
        # the replay indices of the micro-batches in flight
        items["routing replay indices (R2/R3)"] = routing.pop("replay indices")
        host_routing = sum(routing.values())
        items["reserve (CUDA, NCCL, fragmentation)"] = RESERVE_BYTES
        role = RoleMemory(f"trainer (pipeline stage {rank} of {par.pipeline_parallel})", items, capacity,
                          f"TP{par.tensor_parallel} PP{par.pipeline_parallel} EP{par.expert_parallel} "
                          f"ETP{par.etp}{f' CP{par.context_parallel}' if par.context_parallel > 1 else ''} DP{dp} "
                          f"expert-DP{edp}, distributed optimizer "
                          f"{'on' if distributed else 'off'}, {shape}, "
                          f"recompute {'full' if config.model.recompute else 'off'}"
                          + (f"; routing records on the host: {host_routing / GIB:.2f} GiB" if host_routing else ""))
        if best is None or role.total > best.total:
            best = role
    roles = [best]
    if r.engine == "sglang" and not r.urls:
        roles.append(engine_memory(m, r.tensor_parallel, capacity, seq,
                                   inputs.engine_mem_fraction if inputs.engine_mem_fraction is not None else 0.85))
    return roles


def engine_memory(m: MoEModelConfig, tp: int, capacity: int, seq_len: int, mem_fraction: float) -> RoleMemory:
    """One SGLang engine GPU: bf16 weights / TP and the KV cache SGLang makes of the rest of its share."""
    parts = [_layer(m, layer, ParallelConfig()) for layer in range(m.num_layers)]
    total = 2 * m.vocab_size * m.hidden_size + sum(part.dense + part.expert for part in parts)  # + embedding, LM head
    weights = 2 * total // tp
    if m.multi_latent_attention:
        per_token = m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
    else:
        per_token = m.num_layers * 2 * m.num_query_groups * m.head_dim * 2 // tp
    share = int(mem_fraction * capacity)
    kv = max(0, share - weights)
    tokens = kv // per_token
    role = RoleMemory(f"rollout engine (SGLang TP{tp}, mem_fraction {mem_fraction})",
                      {"weights (bf16)": weights, "KV cache": kv}, share,
                      f"KV cache holds {tokens:,} tokens ({per_token:,} bytes each); one sequence is {seq_len:,}",
                      fills_capacity=True)
    if tokens < seq_len:  # the KV cache must hold at least one full sequence
        role = RoleMemory(role.role, {**role.items, "KV cache for one sequence": seq_len * per_token - kv},
                          share, role.note + " (too small)", fills_capacity=True)
    return role


def gpu_totals(config, gpus_per_node: int = 8) -> str:
    """One line: the GPUs and nodes the config takes (trainer ranks, disaggregated engines' GPUs)."""
    r = config.rollout
    trainer = config.world_size
    engines = 0 if r.colocate or r.urls or r.engine != "sglang" else r.num_engines * r.tensor_parallel
    total = trainer + engines
    nodes = -(-trainer // gpus_per_node) + -(-engines // gpus_per_node)  # engines run on nodes of their own
    where = (f"{engines} for {r.num_engines} SGLang engines of TP{r.tensor_parallel} on nodes of their own"
             if engines else "engines colocated with the trainer" if r.colocate else
             "engines given by rollout.urls, not counted" if r.urls else "no GPU engines")
    return (f"total: {total} GPUs = {trainer} for the trainer ({config.world_size} ranks) + {where}; "
            f"{nodes} nodes of {gpus_per_node} GPUs")


def longest_trainer_row(config, inputs: PlanInputs = PlanInputs(), *, limit: int = 1 << 20) -> int:
    """The longest training row (tokens) with which every trainer stage still fits on `inputs.gpu_mem_gib`, by
    bisection over the plan (engines not considered: their KV cache is sized separately); 0 when none fits."""

    def trainer_fits(seq: int) -> bool:
        return all(r.fits for r in plan_memory(config, replace(inputs, seq_len=seq)) if r.role.startswith("trainer"))

    if not trainer_fits(1):
        return 0
    low, high = 1, limit
    if trainer_fits(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if trainer_fits(mid) else (low, mid)
    return low


def format_plan(roles: list[RoleMemory]) -> str:
    lines = []
    for role in roles:
        lines.append(f"{role.role}: {role.total / GIB:.1f} GiB of {role.capacity / GIB:.1f} GiB: {role.verdict}")
        if role.note:
            lines.append(f"  ({role.note})")
        lines += [f"  {name:40s}{value / GIB:10.2f} GiB" for name, value in role.items.items()]
    return "\n".join(lines)


def model_state_bytes(config) -> int:
    """A lower bound of one trainer rank's bytes (its heaviest pipeline stage): the parameters, gradients and
    optimizer state of the policy (critic, KL reference) from plan_memory, without activations or the CUDA reserve,
    and with the distributed optimizer's sharding whatever the config says, so that a run refused by
    check_fits_here could not have fit."""
    config = replace(config, parallel=replace(config.parallel, distributed_optimizer=True))
    trainer = plan_memory(config)[0]
    return sum(v for k, v in trainer.items.items() if k != "activations" and not k.startswith("reserve"))


def check_fits_here(config, *, host_bytes: int | None = None, gpu_bytes: int | None = None) -> None:
    """ConfigError (one line) when the model cannot fit on this machine, before any rank builds it (a 1e9 vocabulary
    made every rank try to allocate 256 GB). With a GPU (or gpu_bytes): one trainer rank's model state (lower bound:
    model_state_bytes) against one GPU's memory. Without (a CPU run: `mpo train` starts its world_size ranks and its
    local engines on this host): every rank's model state plus each local mpo engine's weights against the host's
    physical memory (or host_bytes). Lower bounds only: the full estimate, activations included, is `mpo plan`'s."""
    import torch

    from mpo.config import ConfigError
    from mpo.config_checks import model_config

    m = model_config(config)
    per_rank = model_state_bytes(config)
    shape = (f"vocab_size={m.vocab_size:,}, hidden_size={m.hidden_size:,}, {m.num_layers} layers, "
             f"{m.num_experts} experts")
    if gpu_bytes is None and host_bytes is None and torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    if gpu_bytes is not None:
        if per_rank > gpu_bytes:
            raise ConfigError(f"the model does not fit on this GPU: one trainer rank holds at least "
                              f"{per_rank / GIB:,.1f} GiB of parameters, gradients and optimizer state, the GPU has "
                              f"{gpu_bytes / GIB:,.1f} GiB ({shape}; `mpo plan` shows the whole estimate)")
        return
    capacity = host_bytes if host_bytes is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    r = config.rollout
    engines = r.num_engines if r.engine == "mpo" and not r.urls else 0
    per_engine = stage_params(m, ParallelConfig(), 0).total * (2 if config.engine_dtype == "bf16" else 4)  # whole model
    need = config.world_size * per_rank + engines * per_engine
    if need > capacity:
        raise ConfigError(f"the model does not fit in this host's memory: {config.world_size} trainer ranks x "
                          f"{per_rank / GIB:,.1f} GiB (parameters, gradients, optimizer state) + {engines} engines x "
                          f"{per_engine / GIB:,.1f} GiB (weights) = {need / GIB:,.1f} GiB, the host has "
                          f"{capacity / GIB:,.1f} GiB ({shape})")


SYNC_LINK_GB_S = 25.0  # the stated link: one 200 Gb/s NIC per sender (H100 / H200 nodes' InfiniBand per GPU)
SYNC_CALL_S = 1e-4  # fixed cost of one collective / IPC handle / HTTP payload on the engine side (latency, launch)


@dataclass
class SyncShape:
    """The shape of one weight sync (mpo.weight_sync), from the model's HF tensors and the config alone.

    Attributes:
        transport: the resolved sync.transport.
        senders: senders, one per pipeline stage (EP owners hand their experts to their stage's).
        at_once: whether the senders push at once (Transport.stages_at_once) or take turns.
        engines, engine_tp: the engines and their TP ranks.
        groups_per_engine_gpu: process groups each engine GPU joins (Transport.groups_per_engine_gpu).
        stage_bytes: HF bytes each stage's sender pushes (the trainer's dtype), per stage.
        stage_buckets: buckets per stage (consecutive units up to sync.bucket_mb, as mpo.weight_sync.plan cuts them).
        calls_per_sync: engine-side calls in one sync over every sender and engine (Transport.calls_per_bucket per
            bucket), whatever the number of tensors.
        link_bytes: bytes on the busiest sender link over the sync (a stage's bytes x Transport.link_copies).
        estimate_s: the sync's time at `link_gb_s` per sender link plus SYNC_CALL_S per call: the busiest stage
            when stages push at once, the sum of the stages in turns.
        call_unit: what one call is ("collectives", "HTTP payloads", ...: the transport's Transport.call_unit).
    """

    transport: str
    senders: int
    at_once: bool
    engines: int
    engine_tp: int
    groups_per_engine_gpu: int
    stage_bytes: list[int]
    stage_buckets: list[int]
    calls_per_sync: int
    link_bytes: int
    estimate_s: float
    link_gb_s: float
    call_unit: str = "HTTP payloads"
    nodes: int = 1  # per-node routing (mpo.weight_sync.relay): trainer nodes whose leaders push to their own engines

    def format(self) -> str:
        stages = ", ".join(f"{b / GIB:.2f}" for b in self.stage_bytes)
        calls = self.call_unit
        return "\n".join([
            f"weight sync (sync.transport={self.transport}): {self.senders} sender(s), one per pipeline stage, "
            f"{'alone' if self.senders == 1 else 'pushing at once' if self.at_once else 'taking turns'}, to "
            f"{self.engines} engine(s) of TP{self.engine_tp}",
            f"  groups per engine GPU: {self.groups_per_engine_gpu}"
            + (" (one per sender)" if self.groups_per_engine_gpu else " (no process group)"),
            f"  per sync: {sum(self.stage_buckets)} buckets, {self.calls_per_sync} {calls}; GiB per stage: {stages}",
            # GiB as everywhere in the plan: 25 GB/s (a 200 Gb/s NIC) is 23.3 GiB/s
            *([f"  per node: {self.nodes} trainer nodes, each node's leader rank pushes every bucket to its own "
               f"engines over {self.transport}; each sender sends its buckets to the {self.nodes - 1} other "
               f"leader(s), one packed buffer each"] if self.nodes > 1 else []),
            f"  estimated sync time: {self.estimate_s:.2f} s at {self.link_gb_s * 1e9 / GIB:.1f} GiB/s per sender link "
            f"({self.link_bytes / GIB:.2f} GiB on the busiest sender link, {SYNC_CALL_S * 1e3:g} ms per call)"])


def sync_shape(config, link_gb_s: float = SYNC_LINK_GB_S) -> SyncShape:
    """The sync's shape for `config` (see SyncShape). Walks the HF mapping's units once (names and shapes only)."""
    import math
    import re

    from mpo.config_checks import model_config
    from mpo.models.hf_mapping import mapping_for
    from mpo.weight_sync.transports import NODE_GPUS, resolve_transport, same_host, transport_class

    m, par, r = model_config(config), config.parallel, config.rollout
    stage_of_layer = {layer: stage for stage, chunks in enumerate(par.stage_layers(m.num_layers))
                      for chunk in chunks for layer in chunk}
    pp = par.pipeline_parallel
    itemsize = 2 if config.model.dtype == "bf16" else 4
    bucket_bytes = config.sync.bucket_bytes
    stage_bytes, stage_buckets, open_bytes = [0] * pp, [0] * pp, [None] * pp
    layer_of = re.compile(r"\.layers\.(\d+)\.")
    for unit in mapping_for(m, spec="local").units():
        found = layer_of.search(unit.hf_names[0])
        # the embedding lives on the first stage, the final norm and LM head on the last
        stage = stage_of_layer[int(found.group(1))] if found else 0 if "embed" in unit.hf_names[0] else pp - 1
        nbytes = sum(math.prod(shape) for shape in unit.rule.hf_shapes) * itemsize
        stage_bytes[stage] += nbytes
        if open_bytes[stage] is None or open_bytes[stage] + nbytes > bucket_bytes:
            stage_buckets[stage] += 1
            open_bytes[stage] = 0
        open_bytes[stage] += nbytes
    transport = resolve_transport(config.sync.transport, r.engine, started_here=not r.urls,
                                  is_gpu=r.engine == "sglang", shared_memory=config.sync.host_shared_memory)
    engines = len(r.urls) or r.num_engines
    tp = r.tensor_parallel if r.engine == "sglang" else 1
    via = transport_class(transport)
    at_once = via.stages_at_once(pp, engines)
    # per stage: bytes on the sender's link, calls, seconds
    copies = via.link_copies(engines, tp, at_once)
    # colocated SGLang over several GPU nodes: every other node's leader gets each bucket once from its sender
    nodes = -(-config.world_size // NODE_GPUS) if r.colocate and r.engine == "sglang" else 1
    if nodes > 1 and same_host(transport, r.engine):
        # each node's leader pushes to its own engines: the sender's link carries its own node's share
        copies = copies / nodes + nodes - 1
    else:
        nodes = 1
    calls = [b * via.calls_per_bucket(engines, at_once) for b in stage_buckets]
    seconds = [stage_bytes[s] * copies / (link_gb_s * 1e9) + SYNC_CALL_S * calls[s] for s in range(pp)]
    busiest = max(range(pp), key=lambda s: seconds[s])
    return SyncShape(transport=transport, senders=pp, at_once=at_once, engines=engines, engine_tp=tp,
                     groups_per_engine_gpu=via.groups_per_engine_gpu(pp), call_unit=via.call_unit,
                     stage_bytes=stage_bytes, stage_buckets=stage_buckets, calls_per_sync=sum(calls),
                     link_bytes=int(stage_bytes[busiest] * copies),
                     estimate_s=max(seconds) if at_once else sum(seconds), link_gb_s=link_gb_s, nodes=nodes)
