"""Block-wise FP8 weights for FP8 engines (`rollout.engine_weights: fp8_block`): the trainer quantizes each bucket
into the parameter format of an engine serving a DeepSeek-V3 / Qwen3-FP8 style checkpoint.

The format (HF `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}`): a quantized linear weight W [N, K] travels as `<module>.weight` in
float8_e4m3fn plus `<module>.weight_scale_inv` in float32 of shape [ceil(N/128), ceil(K/128)], one scale per
128 x 128 block; an edge block that is not full (N or K not a multiple of 128, as DeepSeek-V3's kv_a_proj_with_mqa
[576, 7168] has) uses its own scale over the elements it has. Dequantization: every element of block (i, j) is
float(weight) * weight_scale_inv[i, j].

Quantization follows transformers' save path (integrations/finegrained_fp8.py, Fp8Quantize) operation for
operation, so the bytes are the ones a checkpoint written by transformers holds: per block amax = max |W| (in fp32),
scale = 448 / amax (fp32; 448 is float8_e4m3fn's largest finite value; an all-zero block keeps scale 1),
q = clamp(W * scale, -448, 448) cast to e4m3 (round to nearest even), weight_scale_inv = 1 / scale. The clamp
matters: torch's cast to e4m3fn does not saturate, and W * scale can round a hair above 448.

What stays bf16 (as in DeepSeek-V3's FP8 checkpoint and SGLang's FP8 models): embeddings, the LM head, every norm,
the MoE router's gate weight and its e_score_correction_bias, and anything not 2-D (biases included). Experts,
shared experts, attention projections (MLA's low-rank ones too) and dense MLPs are FP8.

Cost at scale: quantization runs on the tensor's own device (the sender's GPU on a cluster), per tensor, with about
two fp32 copies of that one tensor as temporaries; nothing is gathered. Bytes on the wire per quantized element:
1 + 4 / 16384 (vs 2 in bf16).
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = 128  # weight_block_size [128, 128]
SCALE_SUFFIX = "weight_scale_inv"
ENGINE_WEIGHTS = ("bf16", "fp8_block")  # rollout.engine_weights
# The HF config.json entry of a checkpoint in this format (what an engine serving it is started with).
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
# Module names (the last part of the module path) kept in bf16 whatever their shape: embeddings, the LM head and the
# MoE router ("mlp.gate"; not "gate_proj"), Qwen2-MoE's shared-expert gate. Norms are matched by "norm" in the name.
BF16_MODULES = frozenset({"embed_tokens", "lm_head", "gate", "shared_expert_gate"})


def is_quantized(name: str, shape: Iterable[int]) -> bool:
    """Whether the HF tensor `name` of `shape` is FP8 in a block-FP8 checkpoint: a 2-D `.weight` of a linear layer
    that is not an embedding, the LM head, a norm or the MoE router."""
    if not name.endswith(".weight") or len(tuple(shape)) != 2:
        return False
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return module not in BF16_MODULES and "norm" not in module


def scale_name(name: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`."""
    return name[: -len("weight")] + SCALE_SUFFIX


def scale_shape(shape: Iterable[int]) -> tuple[int, int]:
    """[ceil(N / 128), ceil(K / 128)] for a weight [N, K]."""
    n, k = shape
    return -(-n // BLOCK), -(-k // BLOCK)


def quantize_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight of the same shape, float32 weight_scale_inv [ceil(N/128), ceil(K/128)]) of a 2-D weight,
    on its device (module docstring: transformers' arithmetic, ceil-division edge blocks)."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    nb, kb = scale_shape((n, k))
    x = weight.detach().float()
    if (n, k) != (nb * BLOCK, kb * BLOCK):  # edge blocks: zero padding changes no block's amax and is cut off below
        padded = x.new_zeros(nb * BLOCK, kb * BLOCK)
        padded[:n, :k] = x
        x = padded
    blocks = x.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    # `number / tensor` as transformers writes it: torch computes reciprocal(amax) * 448 (two fp32 roundings), which
    # a true division differs from in the last bit now and then; kept so the bytes are the checkpoints'
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    scaled = blocks * scale[:, None, :, None]  # a new tensor: `x` may be the caller's own fp32 weight
    q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(nb * BLOCK, kb * BLOCK)
    if q.shape != (n, k):
        q = q[:n, :k].contiguous()
    return q, (1.0 / scale).float()


def dequantize_block(weight_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 weight: every element of block (i, j) is float(weight_fp8) * scale_inv[i, j] (one fp32 product per
    element, as transformers' and SGLang's dequantization compute it)."""
    n, k = weight_fp8.shape
    if tuple(scale_inv.shape) != scale_shape((n, k)):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight {(n, k)}: expected "
                         f"{scale_shape((n, k))} (blocks of {BLOCK} x {BLOCK})")
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return weight_fp8.float() * scale


def to_engine_format(named: Iterable[tuple[str, torch.Tensor]], fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in the engine's parameter format `fmt` (rollout.engine_weights): "bf16" passes every tensor
    through unchanged; "fp8_block" yields each quantized weight (is_quantized) as `name` in float8_e4m3fn followed by
    `name[:-len('weight')] + 'weight_scale_inv'`, and every other tensor unchanged. Lazy: one tensor converted at a
    time."""
    if fmt not in ENGINE_WEIGHTS:
        raise ValueError(f"engine weights format {fmt!r}; valid values: {', '.join(map(repr, ENGINE_WEIGHTS))}")
    for name, tensor in named:
        if fmt == "fp8_block" and is_quantized(name, tensor.shape):
            q, scale_inv = quantize_block(tensor)
            yield name, q
            yield scale_name(name), scale_inv
        else:
            yield name, tensor


def wire_bytes(shape: Iterable[int], element_size: int, fmt: str, name: str) -> int:
    """Bytes one HF tensor of `shape` (elements of `element_size` bytes in the trainer) takes in format `fmt`."""
    shape = tuple(shape)
    if fmt == "fp8_block" and is_quantized(name, shape):
        return math.prod(shape) + 4 * math.prod(scale_shape(shape))
    return math.prod(shape) * element_size
