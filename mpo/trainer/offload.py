"""The trainer's side of colocated engines (rollout.colocate): its device memory goes to the host while the engines
generate, and comes back before it trains.

What is offloaded, per rank, deduplicated by storage (a parameter living inside megatron DDP's `param_data` buffer is
one storage with it, Adam's state per parameter is one storage each):

* the model: parameters and module buffers of every DDP chunk, and DDP's `param_data` buffers where they exist (the
  distributed optimizer's layout);
* gradients: DDP's `grad_data` buffers (`ddp.buffers` and `ddp.expert_parallel_buffers`, megatron-core 0.19), their
  `extra_main_grads`, and any `.grad` left on model or main parameters. They are not copied: the loop zeroes them
  before every update (`zero_grad_buffer`), so they come back zeroed;
* the optimizer: the inner torch optimizer's parameters and state of every megatron wrapper (every member of a
  ChainedOptimizer). megatron keeps its fp32 main parameters as exactly those parameters
  (Float16OptimizerWithFloat16Params.fp32_from_float16_groups, DistributedOptimizer.shard_fp32_from_float16_groups;
  the FP32Optimizer's are the model's own), and Adam's exp_avg / exp_avg_sq live in its state;
* any extra tensors the owner names (the trainer's KL reference weights).

`offload()` copies each storage byte for byte into a host buffer (pinned on CUDA, allocated at the storage's first
offload and reused every step) and frees the device storage with `untyped_storage().resize_(0)`: every view of it
(parameters in a buffer, `main_grad`, the optimizer's shard views) stays a valid tensor object and sees the data
again after `reload()`, which resizes the storage back and copies the bytes in. Something that caches a storage's
device address (NCCL user buffers, CUDA graphs) would not survive this; the trainer uses neither.

One code path on CPU and GPU; the device differences are two switches set from the device: host buffers are pinned
(and copies non-blocking, followed by one synchronize) on CUDA, and CUDA's caching allocator is emptied after the
offload so the engines can take the memory. On CPU the "host buffer" is host memory as much as the storage was, so
memory does not drop there; the protocol (storages freed to 0 bytes, every value bit-exact after the reload) is the
same, and is what the CPU tests check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

KINDS = ("model", "grad", "optimizer", "extra")


def offload_enabled(rollout: Any) -> bool:
    """rollout.offload_trainer, where None means: on exactly when the engines are colocated."""
    return rollout.colocate if rollout.offload_trainer is None else rollout.offload_trainer


@dataclass
class _Storage:
    """One device storage to free; `copy` is False for storages only gradients live in (zeroed on reload)."""

    storage: torch.UntypedStorage
    nbytes: int
    kind: str  # the first role it was found in (KINDS)
    copy: bool


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view: writes land in the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TrainerOffload:
    """Frees this rank's model, gradient and optimizer storages on `device` and brings them back, bit-exact.

    `offload()` and `reload()` alternate, starting with `offload()`. Every offload walks the models and optimizers
    again (resident then): torch Adam makes its state at a parameter's first step, which may come after the first
    offload (the critic's first update, a policy held back by algorithm.critic_warmup_steps). The walk is cheap next
    to the copies; the host buffers are kept per storage (its StorageImpl, which resize_ keeps) and reused every step.
    Storages on other devices (torch Adam's `step` counter stays on the CPU when the model is on CUDA) are left alone.
    """

    def __init__(self, models: Sequence[torch.nn.Module], optimizers: Sequence[Any], *, device: torch.device,
                 extra: Iterable[torch.Tensor] = ()) -> None:
        self.models, self.optimizers, self.extra = list(models), list(optimizers), list(extra)
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"  # pinned host buffers, non-blocking copies, empty_cache
        self._entries: dict[int, _Storage] = {}  # while offloaded: the storages, by StorageImpl address
        self._bytes = dict.fromkeys(KINDS, 0)  # the last offload's bytes per role
        self._host_bytes = 0
        self._hosts: dict[int, torch.Tensor] = {}  # uint8 host buffer per storage, made at its first offload
        self.offloaded = False
        self.offload_s = self.reload_s = 0.0

    # -- collection ----------------------------------------------------------------------------------------------
    def _collect(self) -> dict[int, _Storage]:
        from mpo.models.chunks import as_chunks

        self._entries = {}
        for model in self.models:
            for chunk in as_chunks(model):
                self._add_ddp(chunk)
        for optimizer in self.optimizers:
            for member in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
                self._add_optimizer(member)
        for tensor in self.extra:
            self._add(tensor, "extra")
        return self._entries

    def _add(self, tensor: Any, kind: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = storage._cdata  # the StorageImpl: shared by every view, unchanged by resize_ (torch's own storage id)
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _Storage(storage, storage.nbytes(), kind, copy=kind != "grad")
        else:  # a storage that holds values as well as gradients (megatron's MXFP8 shared buffer) must be copied
            entry.copy = entry.copy or kind != "grad"

    def _add_ddp(self, ddp: torch.nn.Module) -> None:
        module = getattr(ddp, "module", ddp)
        for param in module.parameters():
            self._add(param, "model")
            self._add(param.grad, "grad")
            self._add(getattr(param, "main_grad", None), "grad")  # a view of grad_data, or an extra main grad
        for buffer in module.buffers():
            self._add(buffer, "model")
        # megatron DDP's buffer lists are instance attributes (`buffers` shadows nn.Module.buffers()); a bare module
        # has none
        for buffer in [*vars(ddp).get("buffers", []), *vars(ddp).get("expert_parallel_buffers", [])]:
            self._add(buffer.param_data, "model")
            self._add(buffer.grad_data, "grad")
            for grad in getattr(buffer, "extra_main_grads", []):
                self._add(grad, "grad")

    def _add_optimizer(self, member: Any) -> None:
        # megatron's wrappers hold a torch optimizer (None for a stub); a torch optimizer is its own
        inner = member if isinstance(member, torch.optim.Optimizer) else getattr(member, "optimizer", None)
        if inner is None:
            return
        for group in inner.param_groups:
            for param in group["params"]:
                self._add(param, "optimizer")  # fp32 main params (or the model's own, already counted)
                self._add(param.grad, "grad")  # megatron points main params' .grad at main_grad: a view
        for state in inner.state.values():
            for value in state.values():
                self._add(value, "optimizer")

    # -- the protocol --------------------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict[str, int]:
        """The last offload's bytes per role (KINDS)."""
        return dict(self._bytes)

    def _synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def _host(self, key: int, nbytes: int) -> torch.Tensor:
        host = self._hosts.get(key)
        if host is None or host.numel() != nbytes:
            host = self._hosts[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_cuda)
        return host

    def offload(self) -> None:
        """Copy every storage (gradients excepted) to its host buffer and free it on the device."""
        if self.offloaded:
            raise RuntimeError("TrainerOffload.offload() called twice: the trainer's storages are already on the host "
                               "(call reload() first)")
        started = time.perf_counter()
        entries = self._collect()
        for key in set(self._hosts) - {k for k, e in entries.items() if e.copy}:  # storages gone since (rare)
            del self._hosts[key]
        self._synchronize()  # the last step's kernels (and grad reduces on side streams) finish before the copies
        for key, entry in entries.items():
            if entry.copy:
                self._host(key, entry.nbytes).copy_(_bytes_of(entry.storage), non_blocking=self.is_cuda)
        self._synchronize()  # the host copies are complete before their sources go
        self._bytes = dict.fromkeys(KINDS, 0)
        for entry in entries.values():
            entry.storage.resize_(0)
            self._bytes[entry.kind] += entry.nbytes
        self._host_bytes = sum(e.nbytes for e in entries.values() if e.copy)
        if self.is_cuda:
            torch.cuda.empty_cache()  # freed blocks stay reserved by the caching allocator until emptied
        self.offloaded = True
        self.offload_s = time.perf_counter() - started

    def reload(self) -> None:
        """Reallocate every storage on the device and copy its bytes back; gradient storages come back zeroed."""
        if not self.offloaded:
            raise RuntimeError("TrainerOffload.reload() without a preceding offload(): the trainer's storages are "
                               "resident")
        started = time.perf_counter()
        for key, entry in self._entries.items():
            entry.storage.resize_(entry.nbytes)
            target = _bytes_of(entry.storage)
            if entry.copy:
                target.copy_(self._hosts[key], non_blocking=self.is_cuda)
            else:
                target.zero_()
        self._synchronize()  # resident before training reads it, and the host buffers are free for the next offload
        self._entries = {}  # holds no storage between steps (one the optimizer replaced, say, on a resume)
        self.offloaded = False
        self.reload_s = time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        """The last offload/reload: device bytes freed, bytes copied to the host, and the seconds each took."""
        return {"offload/bytes": float(sum(self._bytes.values())), "offload/host_bytes": float(self._host_bytes),
                "offload/offload_s": self.offload_s, "offload/reload_s": self.reload_s}
