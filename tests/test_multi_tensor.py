"""mpo.models.multi_tensor: megatron's multi-tensor fallbacks (no TE, no apex: the CPU path) replaced by torch's
foreach kernels must give megatron's results bit for bit: the functions against megatron's own
`local_multi_tensor_l2_norm` / `local_multi_tensor_scale`, and a whole clipped optimizer step (megatron's
ChainedOptimizer, clipping active) against the same step with megatron's fallbacks put back."""

from __future__ import annotations

import torch

from helpers.spawn import spawn_ranks


def _tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 64), (7,), (3, 5, 2), (1,), (128, 33), (0,)]
    return [(torch.randn(shape, generator=generator) * 10 ** (i % 3)).to(dtype) for i, shape in enumerate(shapes)]


def test_foreach_versions_equal_megatrons_fallbacks_bit_for_bit():
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from mpo.models.multi_tensor import foreach_l2_norm, foreach_scale

    flag = torch.zeros(1, dtype=torch.int)
    for dtype in (torch.float32, torch.bfloat16):
        tensors = _tensors(0, dtype)
        ours, _ = foreach_l2_norm(2048 * 32, flag, [tensors], False)
        import megatron.core.utils as utils
        original = utils.torch
        utils.torch = _CpuTorch()  # megatron's fallback allocates its result on "cuda"
        try:
            theirs, _ = local_multi_tensor_l2_norm(2048 * 32, flag, [tensors], False)
        finally:
            utils.torch = original
        assert ours.shape == theirs.shape == (1,) and ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs.cpu()), (ours, theirs)
        for scale in (0.37, 1.0, 3e-5):
            a, b = [t.clone() for t in tensors], [t.clone() for t in tensors]
            foreach_scale(0, flag, [a, a], scale)
            local_multi_tensor_scale(0, flag, [b, b], scale)
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            # into other tensors, another dtype (megatron's main -> model param copy)
            src = _tensors(1)
            a, b = [torch.empty_like(t, dtype=dtype) for t in src], [torch.empty_like(t, dtype=dtype) for t in src]
            foreach_scale(0, flag, [src, a], scale)
            local_multi_tensor_scale(0, flag, [src, b], scale)
            assert all(torch.equal(x, y) for x, y in zip(a, b))


class _CpuTorch:
    """torch, with device="cuda" factories made on the CPU (what mpo's cpu_shims do for megatron's modules)."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name == "tensor":
            return lambda *args, device=None, **kwargs: torch.tensor(*args, **kwargs)
        return value


def _clipped_step_equals_megatrons() -> None:
    import importlib

    from megatron.core import utils

    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.models.ddp import ddp_options, make_optimizer, wrap_ddp
    from mpo.models.multi_tensor import foreach_l2_norm, foreach_scale
    from mpo.parallel import ParallelConfig, initialize_parallel

    ctx = initialize_parallel(ParallelConfig())
    modules = [importlib.import_module(m) for m in ("megatron.core.optimizer.clip_grads",
                                                    "megatron.core.optimizer.optimizer")]
    results = []
    for use_ours in (True, False):
        model = wrap_ddp(build_model(preset("tiny"), ctx.parallel, ctx.device, PrecisionConfig(dtype="fp32"), seed=2),
                         **ddp_options(ctx.parallel, ctx.device))
        optimizer = make_optimizer(model, lr=1e-2, clip_grad=0.5, bf16=False)
        assert modules[0].l2_norm_impl is foreach_l2_norm and modules[0].multi_tensor_scale_impl is foreach_scale
        if not use_ours:  # megatron's own fallbacks, as megatron binds them
            modules[0].l2_norm_impl = utils.local_multi_tensor_l2_norm
            for module in modules:
                module.multi_tensor_scale_impl = utils.local_multi_tensor_scale
        generator = torch.Generator().manual_seed(7)
        norms = []
        for _ in range(3):
            for param in model.parameters():
                param.main_grad.copy_(torch.randn(param.shape, generator=generator))
            _, grad_norm, _ = optimizer.step()
            norms.append(grad_norm)
        assert min(norms) > 0.5  # clipping was active in every step
        results.append((norms, [p.detach().clone() for p in model.parameters()]))
    (norms, params), (ref_norms, ref_params) = results
    assert norms == ref_norms
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_clipped_optimizer_step_equals_megatrons_fallbacks():
    spawn_ranks(1, _clipped_step_equals_megatrons)
