"""Build megatron-core's GPTModel (MoE layers) for the local parallel rank from an MoEModelConfig.

The layer spec is the one device switch: Transformer Engine modules on GPU, megatron-core's local torch modules on
CPU. Parameters are identical either way; only module and checkpoint key names differ (see checkpoints_tools).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mpo.models.config import MoEModelConfig
from mpo.models.families import family_of
from mpo.models.fp32_head import apply_fp32_lm_head
from mpo.parallel.config import ParallelConfig
from mpo.parallel.device import DeviceProfile


@dataclass(frozen=True)
class PrecisionConfig:
    """Numerics of the trained model.

    Attributes:
        dtype: parameter/compute dtype of the transformer body: "bf16" (GPU default) or "fp32" (CPU tests).
        fp32_lm_head: keep the LM head's weight, matmul, logits and everything downstream in fp32 even when the body
            is bf16. On by default: RL ratios exp(logp_new - logp_old) amplify head rounding error.
        router_dtype: dtype of the router's gating matmul and softmax ("fp32" or "fp64").
    """

    dtype: Literal["bf16", "fp32"] = "fp32"
    fp32_lm_head: bool = True
    router_dtype: Literal["fp32", "fp64"] = "fp32"

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"precision.dtype={self.dtype!r}; valid: 'bf16', 'fp32'")
        if self.router_dtype not in ("fp32", "fp64"):
            raise ValueError(f"precision.router_dtype={self.router_dtype!r}; valid: 'fp32', 'fp64'")


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: a multiple of divisible_by * TP, so every TP rank holds an equal vocab slice."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def transformer_config(model: MoEModelConfig, parallel: ParallelConfig, device: DeviceProfile,
                       precision: PrecisionConfig = PrecisionConfig(), *, routing_replay: bool = False,
                       recompute: bool = False):
    """The megatron-core TransformerConfig for this architecture, layout and device."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    bf16 = precision.dtype == "bf16"
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # Tensor/pipeline/expert/context sizes and sequence parallelism.
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        # Uneven stages and virtual stages (model chunks); mpo.parallel.ParallelConfig.stage_layers mirrors them.
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_stage,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.etp,
        context_parallel_size=parallel.context_parallel,
        sequence_parallel=parallel.use_sequence_parallel,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # MoE: Qwen3 routes softmax -> top-k -> renormalise; megatron's pre_softmax=False is exactly that.
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.router_topk,
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype=precision.router_dtype,
        moe_router_load_balancing_type="aux_loss" if model.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.aux_loss_coeff,
        # With no expert- or tensor-parallel peer the dispatcher exchanges nothing, and megatron's allgather
        # dispatcher is then a local permute: the same outputs bit for bit as alltoall's, ~1 ms less per forward of
        # the CPU demo's model (tests/test_dispatcher_choice.py). alltoall wherever tokens cross ranks.
        moe_token_dispatcher_type=("allgather" if parallel.expert_parallel == parallel.etp == parallel.tensor_parallel
                                   == 1 else "alltoall"),
        moe_grouped_gemm=device.layer_spec == "te",  # the local spec has no grouped GEMM (it needs TE)
        moe_enable_routing_replay=routing_replay,
        # The RL loss is already normalised by global (mini-batch) denominators; see mpo.models.forward.
        calculate_per_token_loss=False,
        # Device switches: CPU needs host initialisation and synchronous pipeline p2p.
        use_cpu_initialization=device.cpu_initialization,
        batch_p2p_sync=device.is_gpu,
        # Interleaved (VPP) stages send to the previous and the next stage in one exchange; at PP2 both are the same
        # rank, and a batched isend/irecv cannot tell the two messages apart (measured on gloo: micro-batches' hidden
        # states swapped). Megatron's unbatched path sends the two directions over different groups.
        batch_p2p_comm=parallel.virtual_pipeline_parallel is None,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )
    # The family's own arguments (mpo.models.families): routers, dense leading layers, MLA widths, biases.
    kwargs.update(family_of(model.architecture).transformer_kwargs(model))
    if model.multi_latent_attention:
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def layer_spec(model: MoEModelConfig, device: DeviceProfile, config=None, vp_stage: int | None = None):
    """The layer spec (Qwen3: one spec for every layer) or, for MLA / mixed dense-MoE stacks, megatron's block spec
    with a dense and an MoE layer spec placed by moe_layer_freq (needs the TransformerConfig `config`)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from mpo.models.lean_local import use_lean_modules
    from mpo.models.sdpa_attention import local_fast_paths

    if model.multi_latent_attention or model.first_k_dense:
        if config is None:
            raise ValueError("layer_spec: this architecture needs the TransformerConfig")
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=device.layer_spec == "te",
                                           normalization="RMSNorm", vp_stage=vp_stage)
        if device.layer_spec == "te":
            return block
        if model.multi_latent_attention:
            from mpo.models.mla_local import use_local_mla_core_attention

            use_local_mla_core_attention(block)
        return local_fast_paths(use_lean_modules(block), device, config)
    if device.layer_spec == "te":
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=True, qk_layernorm=model.qk_layernorm)
    # The local spec's linears and experts without megatron's per-call plumbing (mpo.models.lean_local)
    return local_fast_paths(use_lean_modules(get_gpt_layer_local_spec(
        num_experts=model.num_experts, moe_grouped_gemm=False, qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm")), device, config)


def build_model(model: MoEModelConfig, parallel: ParallelConfig, device: DeviceProfile,
                precision: PrecisionConfig = PrecisionConfig(), *, seed: int = 1234, routing_replay: bool = False,
                recompute: bool = False, wrap_float16: bool = True) -> torch.nn.Module:
    """GPTModel for this rank's pipeline stage (megatron parallel_state must be initialised); under virtual
    pipeline parallelism a :class:`~mpo.models.chunks.ModelChunks` of one GPTModel per virtual stage.

    With bf16 the model is wrapped in megatron's Float16Module (as megatron training does); the FP32 LM head is
    applied after wrapping because Float16Module casts every parameter to bf16 on construction.
    """
    from mpo.models.chunks import ModelChunks

    config = transformer_config(model, parallel, device, precision, routing_replay=routing_replay,
                                recompute=recompute)
    # CPU-initialised master weights are drawn from the default generator: seed it identically on every rank.
    torch.manual_seed(seed)
    if parallel.virtual_pipeline_parallel is None:
        return _build_chunk(model, parallel, device, precision, config, None, wrap_float16)
    return ModelChunks([_build_chunk(model, parallel, device, precision, config, vp_stage, wrap_float16)
                        for vp_stage in range(parallel.vpp)])


def _build_chunk(model: MoEModelConfig, parallel: ParallelConfig, device: DeviceProfile, precision: PrecisionConfig,
                 config, vp_stage: int | None, wrap_float16: bool) -> torch.nn.Module:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from mpo.models.short_softmax import pad_short_causal_softmax

    spec = layer_spec(model, device, config, vp_stage)
    if parallel.context_parallel > 1 and device.layer_spec != "te":
        # TE brings ring attention for CP; the local spec gets attention over all-gathered K/V with the same result
        from mpo.models.cp_attention import use_context_parallel_attention

        if model.multi_latent_attention or not use_context_parallel_attention(spec):
            raise ValueError("context parallelism on the local spec: standard attention only (not MLA)")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(model.vocab_size, parallel.tensor_parallel),
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rotary_percent=model.rotary_percent,
        vp_stage=vp_stage,
    )
    if device.is_gpu:
        gpt.cuda(device.device)
    else:  # torch's CPU softmax is ~9x slower below 16 positions: the demo's and the tests' lengths
        pad_short_causal_softmax(gpt)
    head = gpt.output_layer.weight if gpt.post_process and gpt.output_layer.weight is not None else None
    fp32_head_weight = head.detach().clone() if precision.fp32_lm_head and head is not None else None
    result = Float16Module(config, gpt) if precision.dtype == "bf16" and wrap_float16 else gpt
    if precision.fp32_lm_head:
        apply_fp32_lm_head(result)
        if fp32_head_weight is not None:  # undo Float16Module's rounding of the head's initial weights
            gpt.output_layer.weight.data.copy_(fp32_head_weight)
    return result


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (under VPP: ModelChunks of the unwrapped chunks)."""
    from mpo.models.chunks import ModelChunks

    if isinstance(model, ModelChunks):
        return ModelChunks([unwrap(chunk) for chunk in model.chunks])
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model
