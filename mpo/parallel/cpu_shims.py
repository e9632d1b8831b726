"""Patches that let megatron-core run on CPU over gloo. Applied only when CUDA is absent.

megatron-core hard-codes CUDA in a handful of places; each shim below names the site it patches and why. Every
shim is a list of attribute replacements, so it can be removed again: `tests/test_cpu_shims.py` removes each one in
turn and checks that the megatron call it exists for fails without it (the shim is still needed) and works with
it (the shim is right). An upgrade that fixes a site makes that test fail, which is the signal to delete the shim.

Nothing here is applied on a machine with CUDA: there the real kernels, streams and RNG are used unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


@dataclass
class _Patch:
    """Replace `getattr(owner, attr)` with `replacement`; `original` is kept so the patch can be undone."""

    owner: Any
    attr: str
    replacement: Any
    original: Any = None
    had_attr: bool = True

    def apply(self) -> None:
        self.had_attr = self.attr in vars(self.owner)
        self.original = vars(self.owner).get(self.attr)
        setattr(self.owner, self.attr, self.replacement)

    def remove(self) -> None:
        if self.had_attr:
            setattr(self.owner, self.attr, self.original)
        else:
            delattr(self.owner, self.attr)


@dataclass
class Shim:
    """One named CPU shim: what it patches, why, and the patches themselves (built lazily, after megatron imports)."""

    name: str
    why: str
    build: Callable[[], list[_Patch]]
    patches: list[_Patch] = field(default_factory=list)

    @property
    def applied(self) -> bool:
        return bool(self.patches)

    def apply(self) -> None:
        if not self.patches:
            self.patches = self.build()
            for patch in self.patches:
                patch.apply()

    def remove(self) -> None:
        for patch in reversed(self.patches):
            patch.remove()
        self.patches = []

    @contextlib.contextmanager
    def removed(self) -> Iterator[None]:
        """Temporarily undo this shim (tests use it to prove the shim is still needed)."""
        was_applied = self.applied
        self.remove()
        try:
            yield
        finally:
            if was_applied:
                self.apply()


# --- rng ---------------------------------------------------------------------------------------------------------
def _build_rng() -> list[_Patch]:
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        # Same bookkeeping as CudaRNGStatesTracker.add, on the CPU generator instead of torch.cuda's.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    return [
        _Patch(random, "_get_cuda_rng_state", get_state),
        _Patch(random, "_set_cuda_rng_state", set_state),
        _Patch(random.CudaRNGStatesTracker, "add", add),
    ]


# --- current_device ----------------------------------------------------------------------------------------------
def _build_current_device() -> list[_Patch]:
    return [_Patch(torch.cuda, "current_device", lambda: torch.device("cpu"))]


# --- cuda_factories ----------------------------------------------------------------------------------------------
_FACTORY_NAMES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like",
                  "full_like", "rand", "randn", "randint", "randperm", "eye", "linspace")


def _to_cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CpuDeviceTorch(types.ModuleType):
    """Stands in for the name `torch` inside selected megatron modules: factory calls with device="cuda" build on CPU.

    Scoped on purpose: wrapping torch.zeros & co. globally breaks Hugging Face in the same process (transformers 5
    then leaves RoPE's inv_freq buffer uninitialised).
    """

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORY_NAMES:
            @functools.wraps(value)
            def factory(*args: Any, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                return value(*args, **kwargs)

            setattr(self, name, factory)
            return factory
        return value


# megatron modules with `device="cuda"` factory calls that the mpo code paths reach.
_CUDA_FACTORY_MODULES = (
    "megatron.core.transformer.utils",  # get_default_causal_mask
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens in every schedule
    "megatron.core.optimizer.optimizer",  # found_inf / scale buffers
    "megatron.core.optimizer.clip_grads",  # grad-norm buffers
    "megatron.core.utils",  # local_multi_tensor_l2_norm
)


def _build_cuda_factories() -> list[_Patch]:
    proxy = _CpuDeviceTorch()
    return [_Patch(importlib.import_module(name), "torch", proxy) for name in _CUDA_FACTORY_MODULES]


# --- alltoall ----------------------------------------------------------------------------------------------------
class _NoStream:
    """A stream that is always done: CPU work is synchronous."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoStream":
        return self

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NoStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _build_alltoall() -> list[_Patch]:
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher").MoEAlltoAllTokenDispatcher

    def dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        # The CUDA version copies split sizes to the host on a side stream at cuda_dtoh_point and waits for that
        # copy at cuda_sync_point. On CPU the tensors are already on the host: only the numpy conversion remains.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    return [
        # __init__ creates torch.cuda.Stream() unless the class attribute is already set.
        _Patch(dispatcher, "cuda_dtoh_stream", _NoStream()),
        _Patch(dispatcher, "_maybe_dtoh_and_synchronize", dtoh_and_synchronize),
    ]


# --- norm_sp -----------------------------------------------------------------------------------------------------
def _build_norm_sp() -> list[_Patch]:
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
        # WrappedTorchNorm (the local spec's norm without apex) asserts sequence_parallel is off, but MoE training
        # with TP>1 requires it. A torch norm works under SP as long as its weights' grads are all-reduced over TP:
        # tagging them `sequence_parallel` makes finalize_model_grads do exactly that (as TE's norms are tagged).
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        import copy

        no_sp = copy.copy(config)
        no_sp.sequence_parallel = False
        norm = original_new(cls, no_sp, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return [_Patch(torch_norm.WrappedTorchNorm, "__new__", new)]


# --- uneven_gloo -------------------------------------------------------------------------------------------------
def _build_uneven_gloo() -> list[_Patch]:
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    gather_orig = mappings._gather_along_first_dim
    reduce_scatter_orig = mappings._reduce_scatter_along_first_dim

    def gather(input_: torch.Tensor, group: Any, output_split_sizes: list[int] | None = None,
               use_global_buffer: bool = False) -> torch.Tensor:
        # gloo's all_gather rejects chunks of different sizes (alltoall dispatcher with expert-TP > 1):
        # pad every chunk to the largest, gather, and cut the padding off.
        if output_split_sizes is None or group.size() == 1:
            return gather_orig(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        chunks = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(chunks, padded.contiguous(), group=group)
        return torch.cat([chunk[:size] for chunk, size in zip(chunks, output_split_sizes)], dim=0)

    def reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: list[int] | None = None,
                       use_global_buffer: bool = False) -> torch.Tensor:
        # gloo has no reduce_scatter for uneven chunks: all-reduce the whole tensor and keep this rank's slice.
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter_orig(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].contiguous()

    return [
        _Patch(mappings, "_gather_along_first_dim", gather),
        _Patch(mappings, "_reduce_scatter_along_first_dim", reduce_scatter),
    ]


# --- synchronize / current_stream / tensor_type_strings -----------------------------------------------------------
def _build_synchronize() -> list[_Patch]:
    # torch_dist checkpoint saving (filesystem_async.preload_tensors) and pipeline p2p call torch.cuda.synchronize().
    return [_Patch(torch.cuda, "synchronize", lambda device=None: None)]


def _build_current_stream() -> list[_Patch]:
    # megatron DDP's start_grad_sync asks for the current stream to order its grad reduction.
    stream = _NoStream()
    return [_Patch(torch.cuda, "current_stream", lambda device=None: stream),
            _Patch(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())]


def _build_tensor_type_strings() -> list[_Patch]:
    original_type = torch.Tensor.type

    def tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        # megatron's optimizers dispatch on the string 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor';
        # the CPU names lack '.cuda'. Only the no-argument form (a query) is changed; casts go to torch.
        if dtype is None and not kwargs:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return original_type(self, dtype, non_blocking, **kwargs)

    return [_Patch(torch.Tensor, "type", tensor_type)]


def _build_ckpt_exchange() -> list[_Patch]:
    # Fully parallel checkpoint loading (FullyParallelLoadStrategyWrapper) reads each replicated shard on one rank and
    # broadcasts it: the exchange stages tensors on CUDA (`device="cuda"` factories, ShardedTensor.init_data("cuda"),
    # `tensor.cuda()`). On CPU the tensors stay where they are.
    exchange = importlib.import_module("megatron.core.dist_checkpointing.exchange_utils")
    mapping = importlib.import_module("megatron.core.dist_checkpointing.mapping")
    original_broadcast = exchange.exchange_loaded_tensors_broadcast
    original_init = mapping.ShardedTensor.init_data

    def init_data(self: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        return original_init(self, _to_cpu_device(device), *args, **kwargs)

    @functools.wraps(original_broadcast)
    def broadcast(*args: Any, **kwargs: Any) -> Any:
        original_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # only for this call: the exchange's `.cuda()` staging
        try:
            return original_broadcast(*args, **kwargs)
        finally:
            torch.Tensor.cuda = original_cuda

    return [_Patch(exchange, "torch", _CpuDeviceTorch()), _Patch(exchange, "exchange_loaded_tensors_broadcast", broadcast),
            _Patch(mapping.ShardedTensor, "init_data", init_data)]


def _build_adam_step_state() -> list[_Patch]:
    # Without TE or apex megatron's DistributedOptimizer runs torch Adam, whose per-parameter state holds a `step`
    # tensor. Loading a 'fully_reshardable' checkpoint restores that step from the param groups first, then copies each
    # state tensor it has into every tensor of the parameter's state, `step` included, which the checkpoint's per-param
    # tensors do not have (KeyError 'step'). Keep the restored step: copy it onto itself.
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer").DistributedOptimizer
    original = distrib._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict) -> Any:
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state.get(main_param, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                # megatron restored that step as ONE tensor shared by every parameter; torch Adam increments each
                # parameter's step in place, so shared it would advance once per parameter. Give each its own.
                state["step"] = step.clone()
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    original_state_dict = distrib.state_dict

    def state_dict(self: Any) -> Any:
        # ... and its state_dict() reads the step from that per-parameter state, asserting one common value, which a
        # fresh optimizer (resume at start-up: the sharded state dict to load into is built first) does not have yet.
        # Create the state torch Adam would create at its first step (zero moments, step 0): the same run either way.
        inner = self.optimizer
        if isinstance(inner, torch.optim.Adam) and not any(inner.state.get(p) for g in inner.param_groups
                                                             for p in g["params"]):
            self.init_state_fn(inner, self.config)
            for group in inner.param_groups:
                for param in group["params"]:
                    inner.state[param]["step"] = torch.tensor(0.0)
        return original_state_dict(self)

    return [_Patch(distrib, "_set_main_param_and_optimizer_states", set_states),
            _Patch(distrib, "state_dict", state_dict)]


def _build_cp_rope() -> list[_Patch]:
    # Under context parallelism the rotary embedding picks this rank's two chunks with an index tensor moved to CUDA
    # (`.cuda(non_blocking=True)` from pinned memory). The same selection with the index on the embedding's device.
    rope = importlib.import_module("megatron.core.models.common.embeddings.rotary_pos_embedding")

    def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        size, rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    return [_Patch(rope, "get_pos_emb_on_this_cp_rank", get_pos_emb_on_this_cp_rank)]


SHIMS: dict[str, Shim] = {
    shim.name: shim
    for shim in (
        Shim("rng", "CudaRNGStatesTracker seeds and forks torch.cuda's generator; use the CPU generator.",
             _build_rng),
        Shim("current_device", "~200 megatron sites allocate on torch.cuda.current_device(); answer 'cpu'.",
             _build_current_device),
        Shim("cuda_factories", "hard-coded device='cuda' in the causal mask, schedules and optimizers; "
             "remap inside those megatron modules only.", _build_cuda_factories),
        Shim("alltoall", "the alltoall dispatcher copies split sizes to host on a CUDA stream; do it inline.",
             _build_alltoall),
        Shim("norm_sp", "torch LayerNorm/RMSNorm refuses sequence parallelism, which MoE+TP training requires.",
             _build_norm_sp),
        Shim("uneven_gloo", "gloo cannot all-gather or reduce-scatter uneven chunks (alltoall with expert-TP>1).",
             _build_uneven_gloo),
        Shim("synchronize", "torch.cuda.synchronize() in checkpoint saving and pipeline p2p.", _build_synchronize),
        Shim("current_stream", "megatron DDP orders grad reduction on torch.cuda.current_stream().",
             _build_current_stream),
        Shim("tensor_type_strings", "megatron optimizers compare Tensor.type() with 'torch.cuda.*' names.",
             _build_tensor_type_strings),
        Shim("adam_step_state", "torch Adam (no TE/apex) keeps a per-parameter step that megatron's reshardable "
             "DistributedOptimizer load does not supply.", _build_adam_step_state),
        Shim("ckpt_exchange", "fully parallel checkpoint loading stages the shards it exchanges on CUDA.",
             _build_ckpt_exchange),
        Shim("cp_rope", "context parallelism's rotary embedding moves its chunk index to CUDA.", _build_cp_rope),
    )
}


def apply_cpu_shims() -> list[str]:
    """Apply every shim if CUDA is absent (idempotent). Returns the names of the shims now applied."""
    if torch.cuda.is_available():  # the one switch: shims are for hosts without CUDA
        return []
    for shim in SHIMS.values():
        shim.apply()
    return [name for name, shim in SHIMS.items() if shim.applied]
