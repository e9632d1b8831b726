"""megatron-core's local layer spec on the GPU computes what HF transformers computes in fp32 on the CPU, on the same
checkpoint: what the offline tier (no Transformer Engine) can prove about the GPU numerics it trains with.

A tiny random Qwen3-MoE (HF, fp32) converted with checkpoints_tools; on one GPU (NCCL, world 1) the local-spec model
at fp32 (TF32 off) and at bf16 with the FP32 LM head; the reference is `transformers`' own model on the CPU in fp32,
which shares no code with mpo or megatron. fp32: logits and log-probs within 1e-4 (GPU and CPU kernels sum in other
orders; a wrong weight or route is O(0.1-1)). bf16: the rounding of a bf16 body (mean |log-prob diff| <= 2e-2, the
CPU measurement of bf16 vs fp32 of the same model is ~1e-2).
"""

from __future__ import annotations

import pytest
import torch

from helpers.spawn import spawn_ranks
from helpers.tiny_hf import make_tiny_qwen3_moe

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-4
BF16_MEAN_TOL = 2e-2


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    import te_parity_worker
    from transformers import AutoModelForCausalLM

    from checkpoints_tools import hf_to_mcore

    work = tmp_path_factory.mktemp("local_parity")
    hf_dir = make_tiny_qwen3_moe(work / "hf", seed=5, vocab=256)
    hf_to_mcore(hf_dir, work / "mc", show_progress=False)
    rows = torch.randint(4, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    spawn_ranks(1, te_parity_worker.run, str(work / "out.pt"), str(work / "mc"), rows.tolist(), ("local",))
    results = torch.load(work / "out.pt", weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(rows).logits.double()
    logprobs = torch.zeros(rows.shape, dtype=torch.float64)
    logprobs[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, rows[:, 1:, None])[..., 0]
    results["hf_cpu_fp32"] = {"logits": logits, "logprobs": logprobs}
    return results


def test_fp32_local_spec_on_gpu_equals_hf_on_cpu(outputs):
    from record import record

    gpu, ref = outputs["local_fp32"], outputs["hf_cpu_fp32"]
    logits = (gpu["logits"] - ref["logits"]).abs().max().item()
    logprobs = (gpu["logprobs"] - ref["logprobs"]).abs().max().item()
    record("parity_fp32", f"fp32 local spec on GPU vs HF fp32 on CPU: max |logits diff| {logits:.2e}, max |log-prob "
           f"diff| {logprobs:.2e} (bound {FP32_TOL:g})", max_logits_diff=logits, max_logprob_diff=logprobs)
    assert logits <= FP32_TOL and logprobs <= FP32_TOL


def test_bf16_local_spec_on_gpu_is_within_bf16_rounding_of_hf_fp32(outputs):
    from record import record

    diff = (outputs["local_bf16"]["logprobs"] - outputs["hf_cpu_fp32"]["logprobs"]).abs()
    record("parity_bf16", f"bf16 local spec (FP32 head) on GPU vs HF fp32 on CPU: mean |log-prob diff| "
           f"{diff.mean().item():.2e}, max {diff.max().item():.2e} (mean bound {BF16_MEAN_TOL:g})",
           mean_logprob_diff=diff.mean().item(), max_logprob_diff=diff.max().item())
    assert diff.mean().item() <= BF16_MEAN_TOL and diff.max().item() <= 0.5
