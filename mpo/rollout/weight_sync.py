"""In-place weight sync, trainer -> engines, after each optimizer step.

The trainer streams its TP/PP/EP shards bucket by bucket (mpo.rollout.streaming: each pipeline stage's sender
assembles units, converts megatron names to Hugging Face names with the same mapping checkpoints_tools uses, and
calls push_bucket here), all inside SGLang's weight-update session (pause -> begin -> buckets -> end -> continue).
`push` does the same for a list of HF tensors held by one process (tests, the bench, a restarted local engine).
Then it verifies: mpo's engine reports a checksum of its weights that must equal the trainer's (combine_digests of
per-tensor digests, so the trainer never needs all weights in one place); SGLang has no such endpoint for MoE models,
so the caller compares the engine's log-probs of probe sequences with its own (verify_by_probe). The probe is
built from the engine's own routed experts (covering_probes): extended until every expert of every MoE layer is
routed to at least once, so one expert left stale by a sync changes some probe log-prob.

Two transports, for both engine kinds (config `rollout.sync`):
* "tensor": each bucket travels in the HTTP body of /update_weights_from_tensor. mpo's engine takes
  `load_format="mpo_safetensors"` (base64 safetensors bytes: data only, never pickle); SGLang takes
  `load_format="flattened_bucket"` (one dtype per bucket, tensor bytes inline in the pickle; see
  mpo.rollout.sglang_wire).
* "distributed": once per sender the sender (rank 0 of the group, hosting the rendezvous) and every engine rank join
  one process group (/init_weights_update_group; engine i's ranks start at 1 + the TP sizes of the engines before it;
  gloo on CPU, NCCL on GPU; each sender's group has its own name). Per bucket every engine gets
  /update_weights_from_distributed (names, dtypes, shapes) in a thread while the sender broadcasts each tensor, in
  order, on that group.
* "cuda_ipc" (GPU only, not run on CPU): SGLang engines on the trainer's own GPUs get /update_weights_from_tensor
  with a flattened bucket whose tensor is a CUDA IPC handle (cuda_ipc_payload); no bytes are copied.
* "shm" (CPU, mpo engines on the trainer's host): the same idea in host memory. A bucket that lies in a shared
  slot (mpo.rollout.streaming allocates its slots in /dev/shm on CPU) travels as locators (file, offset, shape,
  stride: `load_format="mpo_shm"`); tensors elsewhere are first copied into this WeightSync's shared spill buffer.
  The engine copies the values out before it answers, so the sender may reuse the slot right after.
All run inside SGLang's weight-update session (pause -> begin -> buckets -> end -> continue).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from mpo.parallel.ports import free_port
from mpo.rollout.client import EngineClient, EngineError
from mpo.rollout.protocol import decode_routed_experts
from mpo.rollout.sglang_wire import dtype_name, flattened_bucket_payload, join_weight_update_group, split_by_dtype

MPO_FORMAT = "mpo_safetensors"
SHM_FORMAT = "mpo_shm"
SGLANG_FORMAT = "flattened_bucket"
NamedTensors = list[tuple[str, torch.Tensor]]
EngineKind = Literal["mpo", "sglang"]
Transport = Literal["tensor", "distributed", "cuda_ipc", "shm"]
TRANSPORTS = ("tensor", "distributed", "cuda_ipc", "shm")


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of one tensor's values upcast to fp32 (exact for bf16), so a bf16 engine can be checked against an fp32
    trainer whose weights are rounded the way the engine stores them (see WeightSync.verify)."""
    data = tensor.detach().float().contiguous().cpu()  # no copy for a contiguous fp32 CPU tensor
    return hashlib.sha256(data.view(-1).view(torch.uint8).numpy() if data.numel() else b"").hexdigest()


def combine_digests(digests: dict[str, str]) -> str:
    """The weights checksum from per-tensor digests: sha256 over (name, digest) in name order. Order-free on the
    sending side: senders of a streaming sync hash their own buckets, and only the small digest map meets on one
    rank (no full-model gather)."""
    combined = hashlib.sha256()
    for name in sorted(digests):
        combined.update(name.encode())
        combined.update(digests[name].encode())
    return combined.hexdigest()


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Checksum of HF-named tensors: equal iff every weight has the same value (combine_digests of tensor_digest)."""
    return combine_digests({name: tensor_digest(tensor) for name, tensor in named})


def make_buckets(named: NamedTensors, bucket_bytes: int) -> list[NamedTensors]:
    """Consecutive groups of at most bucket_bytes each (a larger single tensor gets a bucket of its own)."""
    buckets: list[NamedTensors] = []
    current: NamedTensors = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def encode_mpo_bucket(bucket: NamedTensors) -> str:
    # Views (a streaming bucket's tensors share one slot) are copied: safetensors refuses tensors sharing storage.
    return base64.b64encode(safetensors_save({name: t.clone() if t._base is not None else t.contiguous()
                                              for name, t in bucket})).decode("ascii")


def decode_mpo_bucket(payload: str) -> dict[str, torch.Tensor]:
    return safetensors_load(base64.b64decode(payload))


@dataclass
class SyncReport:
    seconds: float
    bytes: int
    buckets: int
    transport: str = "tensor"

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, float]:
        return {"sync_time_s": self.seconds, "sync_bytes": float(self.bytes), "sync_bytes_per_s": self.bytes_per_s}




def group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the distributed weight-update group: the trainer is rank 0, engine
    i's TP ranks follow the engines before it. The launcher's plan states the same layout (launch/plan.py)."""
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
    return 1 + sum(tp_sizes), offsets


def cuda_ipc_payload(named_tensors: NamedTensors) -> str:
    """A flattened_bucket payload whose tensor travels as a CUDA IPC handle (GPU only; not run on CPU): pickled by
    torch's ForkingPickler, which reduces CUDA tensors to IPC handles, then base64 (sglang's
    MultiprocessingSerializer.serialize(..., output_str=True) writes the same)."""
    import io
    import pickle

    from multiprocessing.reduction import ForkingPickler  # torch 2.11 no longer re-exports it from its reductions

    from torch.multiprocessing.reductions import init_reductions

    from mpo.rollout.sglang_wire import flatten_bucket

    init_reductions()
    flat = flatten_bucket(named_tensors, device=named_tensors[0][1].device)
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(flat)
    return base64.b64encode(buf.getvalue()).decode("ascii")


log = logging.getLogger(__name__)


class _Calls:
    """HTTP calls to several engines in threads, so the trainer can take part in a collective meanwhile."""

    def __init__(self, clients: Sequence[EngineClient], call: Callable[[EngineClient], Any]) -> None:
        self.errors: dict[str, BaseException] = {}
        self.threads = [threading.Thread(target=self._run, args=(client, call), daemon=True) for client in clients]
        for thread in self.threads:
            thread.start()

    def _run(self, client: EngineClient, call: Callable[[EngineClient], Any]) -> None:
        try:
            call(client)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            self.errors[client.url] = exc

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def raise_first(self, tolerate: Callable[[str, BaseException], bool] | None = None) -> None:
        """Raise the first error that `tolerate(url, error)` does not accept (all of them without it)."""
        for url, exc in self.errors.items():
            if tolerate is None or not tolerate(url, exc):
                raise exc

    def join(self, timeout_s: float, tolerate: Callable[[str, BaseException], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.raise_first(tolerate)
        if not self.done():
            raise TimeoutError(f"engine calls did not return within {timeout_s:.0f} s")


class PendingPush:
    """One bucket's engine calls, still running in threads (WeightSync.push_bucket(wait=False))."""

    def __init__(self, calls: _Calls, timeout_s: float,
                 tolerate: Callable[[str, BaseException], bool] | None = None) -> None:
        self.calls, self.timeout_s, self.tolerate = calls, timeout_s, tolerate

    def wait(self) -> None:
        """Return once every engine answered; raise the first engine's error (except one WeightSync dropped: an
        expendable engine that died), or TimeoutError after timeout_s."""
        self.calls.join(self.timeout_s, self.tolerate)


class WeightSync:
    """Pushes HF-named weights to every engine of one kind over one transport, and verifies them.

    Args:
        clients: the engines (all of `engine` kind).
        engine: "mpo" or "sglang": picks the tensor-path payload and the verification.
        transport: "tensor" or "distributed" (module docstring).
        bucket_bytes: bucket size.
        tp_sizes: TP size of each engine (distributed ranks; tensor payloads are sent once per TP rank).
        backend: process-group backend for "distributed" (default: nccl when CUDA is available, else gloo).
        master_address: address the engines reach the trainer's rendezvous at.
        timeout_s: how long a collective step may take before the sync fails.
    """

    def __init__(self, clients: Sequence[EngineClient], *, engine: EngineKind = "mpo", transport: Transport = "tensor",
                 bucket_bytes: int = 64 << 20, tp_sizes: Sequence[int] | None = None, backend: str | None = None,
                 master_address: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        if engine not in ("mpo", "sglang"):
            raise ValueError(f"engine must be 'mpo' or 'sglang', got {engine!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "cuda_ipc" and engine != "sglang":
            raise ValueError("transport 'cuda_ipc' is SGLang's colocated path; engine must be 'sglang'")
        if transport == "shm":
            from urllib.parse import urlsplit

            from mpo.parallel.ports import is_local_host

            if engine != "mpo":
                raise ValueError("transport 'shm' is mpo's engine's same-host path; engine must be 'mpo'")
            remote = [c.url for c in clients if not is_local_host(urlsplit(c.url).hostname or "")]
            if remote:
                raise ValueError(f"transport 'shm' needs engines on this host; {', '.join(remote)} is on another: "
                                 f"use 'distributed'")
        self.clients = list(clients)
        self.engine, self.transport, self.bucket_bytes = engine, transport, bucket_bytes
        self.tp_sizes = list(tp_sizes or [1] * len(self.clients))
        if len(self.tp_sizes) != len(self.clients):
            raise ValueError(f"{len(self.tp_sizes)} tp_sizes for {len(self.clients)} engines")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.master_address, self.timeout_s = master_address, timeout_s
        self.group: torch.distributed.ProcessGroup | None = None
        self.group_name = f"mpo_weight_sync_{uuid.uuid4().hex[:8]}"
        self._spill = None  # shm transport: shared buffer for tensors that are not in a shared slot already
        # expendable(client): whether that engine, having failed a call, may be left out of the rest of the session
        # (EngineSet: a local engine whose process died, which it restarts with the session's weights afterwards).
        # None: every engine error fails the sync.
        self.expendable: Callable[[EngineClient], bool] | None = None
        self.lost: set[str] = set()  # URLs left out of the current session

    # -- pushing ---------------------------------------------------------------------------------------------------
    def push(self, named: NamedTensors, version: str) -> SyncReport:
        """Every tensor of `named` to every engine, in one weight-update session tagged `version` (one sender: the
        trainer's streaming sync uses begin_session / push_bucket / end_session across its senders)."""
        started = time.perf_counter()
        buckets = make_buckets(named, self.bucket_bytes)
        self.begin_session()
        try:
            for bucket in buckets:
                self.push_bucket(bucket, version)
        finally:
            self.end_session()
        total = sum(t.numel() * t.element_size() for _, t in named)
        return SyncReport(time.perf_counter() - started, total, len(buckets), self.transport)

    def begin_session(self) -> None:
        """Pause generation and open SGLang's weight-update session on every engine (once per sync, one caller)."""
        self.lost = set()
        self._each(lambda client: (client.pause_generation(mode="in_place"), client.begin_weight_update()))

    def end_session(self) -> None:
        """Close the session (the updates take effect) and resume generation on every engine."""
        self._each(lambda client: (client.end_weight_update(), client.continue_generation()))

    def _live(self) -> list[tuple[EngineClient, int]]:
        """(client, TP size) of the engines still in the session."""
        return [(c, tp) for c, tp in zip(self.clients, self.tp_sizes) if c.url not in self.lost]

    def _each(self, call: Callable[[EngineClient], Any]) -> None:
        for client, _ in self._live():
            try:
                call(client)
            except EngineError as exc:
                if not self._drop(client.url, exc):
                    raise

    def _drop(self, url: str, exc: BaseException) -> bool:
        """Leave the engine at `url` out of the rest of this session if it failed in transport and is expendable."""
        client = next((c for c in self.clients if c.url == url), None)
        if (client is None or self.expendable is None or not isinstance(exc, EngineError) or not exc.retryable
                or not self.expendable(client)):
            return False
        log.warning("engine %s failed during the weight update (%s); left out of it (it is restarted with these "
                    "weights)", url, exc)
        self.lost.add(url)
        return True

    def push_bucket(self, bucket: NamedTensors, version: str, *, wait: bool = True) -> "PendingPush | None":
        """One bucket of HF-named tensors to every engine, inside an open session (any sender may call it).

        wait=False (shm transport; the others always wait): return once the engines were asked, with a PendingPush
        whose wait() returns when every engine has copied the bucket out; until then its memory must not change.
        The streaming sync uses this to place the next bucket while the engines read this one."""
        if self.transport == "distributed" and self.group is None:
            self.connect()
        if self.transport == "tensor":
            self._push_tensor(bucket, version)
        elif self.transport == "cuda_ipc":
            self._push_cuda_ipc(bucket, version)
        elif self.transport == "shm":
            return self._push_shm(bucket, version, wait)
        else:
            self._push_distributed(bucket, version)
        return None

    def _push_tensor(self, bucket: NamedTensors, version: str) -> None:
        if self.engine == "mpo":
            payloads = [(MPO_FORMAT, encode_mpo_bucket(bucket))]
        else:
            payloads = [(SGLANG_FORMAT, flattened_bucket_payload(run)) for run in split_by_dtype(bucket)]
        for load_format, payload in payloads:
            for client, tp in self._live():
                try:
                    client.update_weights_from_tensor([payload] * tp, load_format=load_format, weight_version=version)
                except EngineError as exc:
                    if not self._drop(client.url, exc):
                        raise

    def _push_cuda_ipc(self, bucket: NamedTensors, version: str) -> None:
        """SGLang's colocated path: the bucket stays on this GPU and the engine maps it through CUDA IPC handles
        (torch's ForkingPickler reductions, as sglang's MultiprocessingSerializer writes them), one payload per
        engine TP rank. NOT RUN ON CPU (no CUDA here): GPU-only, checked on the lent GPU machine when there is one.
        The engines must run on this node's GPUs; the tensors stay alive until every engine replied."""
        if not torch.cuda.is_available():
            raise EngineError(self.clients[0].url, "/update_weights_from_tensor",
                              "rollout.sync='cuda_ipc' needs CUDA (colocated engines on the trainer's GPUs)",
                              retryable=False)
        device = torch.device("cuda", torch.cuda.current_device())
        for run in split_by_dtype(bucket):
            on_device = [(name, t.detach().to(device).contiguous()) for name, t in run]
            payload = cuda_ipc_payload(on_device)
            for client, tp in zip(self.clients, self.tp_sizes):
                client.update_weights_from_tensor([payload] * tp, load_format=SGLANG_FORMAT, weight_version=version)
            torch.cuda.synchronize(device)

    def _push_shm(self, bucket: NamedTensors, version: str, wait: bool) -> "PendingPush | None":
        """Same-host mpo engines read the bucket in place: locators for tensors already in a shared slot (strided
        views included: the streaming sync's q/k/v), one copy into the spill buffer for the rest (a plain list of
        tensors, as push() gets). A bucket that needed the spill buffer is always waited for (the buffer is reused
        by the next bucket)."""
        import json

        from mpo.rollout.shared_memory import SharedBuffer, file_name, locate, new_token

        located, missing = [], []
        for name, tensor in bucket:
            tensor = tensor.detach()
            loc = locate(name, tensor)  # None unless it lies in a shared buffer of this process (CPU)
            (located.append(loc) if loc is not None else missing.append((name, tensor)))
        if missing:
            align = 64
            sizes = [-(-t.numel() * t.element_size() // align) * align for _, t in missing]
            if self._spill is None or self._spill.numel < sum(sizes):
                if self._spill is not None:
                    self._spill.close()
                self._spill = SharedBuffer(file_name(new_token(), "spill"), max(sum(sizes), self.bucket_bytes),
                                           torch.uint8, create=True)
            at = 0
            for (name, tensor), size in zip(missing, sizes):
                nbytes = tensor.numel() * tensor.element_size()
                view = self._spill.tensor[at: at + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)
                located.append(locate(name, view))
                at += size
        payload = json.dumps([loc.to_json() for loc in located])
        live = self._live()
        tp_of = {id(c): tp for c, tp in live}
        pending = PendingPush(_Calls([c for c, _ in live], lambda client: client.update_weights_from_tensor(
            [payload] * tp_of[id(client)], load_format=SHM_FORMAT, weight_version=version)), self.timeout_s,
            self._drop)
        if wait or missing:
            pending.wait()
            return None
        return pending

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _push_distributed(self, bucket: NamedTensors, version: str) -> None:
        names = [name for name, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        calls = _Calls(self.clients, lambda c: c.update_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=self.group_name, weight_version=version))
        device = self._device()
        sent = [t.detach().to(device).contiguous() for _, t in bucket]  # alive until every broadcast completed
        works = [torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in sent]
        # An engine that refuses before receiving (e.g. an unknown group) would leave the broadcasts waiting:
        # poll both, and fail with the engine's own error as soon as one comes back.
        deadline = time.monotonic() + self.timeout_s
        while not (calls.done() and all(w.is_completed() for w in works)):
            if calls.errors and not all(w.is_completed() for w in works):
                self.group = None  # the group is out of step now; the next push makes a new one
                calls.raise_first()
            if time.monotonic() > deadline:
                raise EngineError(self.clients[0].url, "/update_weights_from_distributed",
                                  f"bucket of {len(names)} tensors not done after {self.timeout_s:.0f} s")
            time.sleep(0.001)
        calls.raise_first()

    # -- the process group (distributed transport) ----------------------------------------------------------------
    def connect(self) -> None:
        """Create the weight-update group: trainer rank 0 plus every engine rank (engine i from rank_offset)."""
        port = free_port()
        world_size, offsets = group_layout(self.tp_sizes)
        by_url = dict(zip((c.url for c in self.clients), offsets))
        calls = _Calls(self.clients, lambda c: c.init_weights_update_group(
            master_address=self.master_address, master_port=port, rank_offset=by_url[c.url], world_size=world_size,
            group_name=self.group_name, backend=self.backend))
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = join_weight_update_group(self.master_address, port, world_size, self.group_name,
                                                           backend=self.backend, rank=0,
                                                           timeout=timedelta(seconds=self.timeout_s))
            except BaseException as exc:  # noqa: BLE001
                joined["error"] = exc

        trainer = threading.Thread(target=join, daemon=True)
        trainer.start()
        deadline = time.monotonic() + self.timeout_s
        while trainer.is_alive() or not calls.done():
            if calls.errors:
                calls.raise_first()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight-update group {self.group_name}: not all of {world_size} ranks joined "
                                   f"within {self.timeout_s:.0f} s")
            time.sleep(0.01)
        calls.raise_first()
        if "error" in joined:
            raise joined["error"]
        self.group = joined["group"]

    def close(self) -> None:
        """Tear the weight-update group down on the engines and here (distributed transport); free the shm spill."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        if self.group is None:
            return
        try:
            for client in self.clients:
                client.call("/destroy_weights_update_group", {"group_name": self.group_name})
        finally:
            torch.distributed.destroy_process_group(self.group)
            self.group = None

    # -- verification ----------------------------------------------------------------------------------------------
    def verify(self, named: NamedTensors, *, engine_dtype: torch.dtype = torch.float32,
               fp32_names: set[str] = frozenset()) -> None:
        """mpo engines: their checksum must equal the trainer's weights as the engine stores them (cast to
        engine_dtype, except fp32_names such as an FP32 LM head). Raises EngineError naming the engine otherwise."""
        self.verify_checksum(weights_checksum((name, t if name in fp32_names else t.to(engine_dtype))
                                              for name, t in named))

    def verify_checksum(self, expected: str) -> None:
        """Every engine's /weights_checksum must equal `expected` (see combine_digests); engines left out of the
        session are not asked (restarted, they get the session's weights)."""
        for client, _ in self._live():
            got = client.call("/weights_checksum", method="GET")["checksum"]
            if got != expected:
                raise EngineError(client.url, "/weights_checksum", f"weights differ from the trainer's after sync "
                                  f"(engine {got[:12]}, trainer {expected[:12]})", retryable=False)

    def verify_by_probe(self, probes: Sequence[Sequence[int]], trainer_logprobs: Sequence[Sequence[float]], *,
                        tolerance: float = 1e-3) -> float:
        """SGLang engines (no weights checksum for MoE models): each engine's log-probs of every probe sequence must
        be within `tolerance` of the trainer's. `trainer_logprobs[j][i]` is log p(probes[j][i] | probes[j][:i]);
        position 0 has none and is ignored. Build `probes` with covering_probes, so that a stale expert anywhere
        changes some log-prob. Returns the largest |diff| over engines; raises EngineError naming the engine."""
        if len(trainer_logprobs) != len(probes):
            raise ValueError(f"trainer log-probs for {len(trainer_logprobs)} probe sequences, not {len(probes)}")
        references = []
        for j, (probe, logprobs) in enumerate(zip(probes, trainer_logprobs)):
            if len(logprobs) != len(probe):
                raise ValueError(f"{len(logprobs)} trainer log-probs for probe sequence {j} of {len(probe)} tokens")
            references.append(torch.tensor([float(x) for x in logprobs[1:]], dtype=torch.float64))
        worst = 0.0
        for client in self.clients:
            runs = run_probes(client, probes)
            diffs = [(torch.tensor(run.logprobs, dtype=torch.float64) - ref).abs() for run, ref in zip(runs, references)]
            per_probe = [d.max().item() if d.numel() else 0.0 for d in diffs]
            j = max(range(len(per_probe)), key=lambda k: (per_probe[k] != per_probe[k], per_probe[k]))  # NaN first
            diff = per_probe[j]
            if not diff <= tolerance:  # NaN fails too
                raise EngineError(client.url, "/generate", f"probe log-probs differ from the trainer's by {diff:.3g} "
                                  f"(probe sequence {j} of {len(probes)}; tolerance {tolerance:g}) after weight sync",
                                  retryable=False)
            worst = max(worst, diff)
        return worst


# -- the probe -----------------------------------------------------------------------------------------------------
@dataclass
class ProbeRun:
    """One probe sequence as an engine scored it.

    Attributes:
        logprobs: log p(probe[i] | probe[:i]) for i >= 1.
        routes: int32 [n - 1, layers, top_k]: the experts the engine routed input position p < n - 1 to (the last
            token's routing only shapes the generated token, which is not compared), or None if not asked for.
    """

    logprobs: list[float]
    routes: np.ndarray | None = None


def run_probes(client: EngineClient, probes: Sequence[Sequence[int]], *, num_layers: int | None = None,
               topk: int | None = None) -> list[ProbeRun]:
    """Every probe sequence in one batched /generate (logprob_start_len=0, one greedy new token): the engine's
    log-probs of the probe tokens from meta_info.input_token_logprobs ([logprob, token_id, text] per input token;
    the first has no logprob) and, when num_layers and topk are given, its routed experts."""
    want_routes = num_layers is not None and topk is not None
    body = {"input_ids": [list(p) for p in probes], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    if want_routes:
        body["return_routed_experts"] = True
    replies = client.call("/generate", body)
    if not isinstance(replies, list) or len(replies) != len(probes):
        raise EngineError(client.url, "/generate", f"expected {len(probes)} responses to the batched probe, got "
                          f"{type(replies).__name__}", retryable=False)
    runs = []
    for j, (probe, reply) in enumerate(zip(probes, replies)):
        meta = reply.get("meta_info") or {}
        entries = meta.get("input_token_logprobs") or []
        if len(entries) != len(probe) or [int(e[1]) for e in entries] != list(probe):
            raise EngineError(client.url, "/generate", f"input_token_logprobs does not cover the {len(probe)}-token "
                              f"probe sequence {j} (got {len(entries)} entries)", retryable=False)
        routes = None
        if want_routes:
            if "routed_experts" not in meta:
                raise EngineError(client.url, "/generate", "no meta_info.routed_experts for the probe: start the "
                                  "engine with --enable-return-routed-experts", retryable=False)
            rows = len(probe) + len(reply.get("output_ids") or []) - 1
            try:
                routes = decode_routed_experts(meta["routed_experts"], rows=rows, num_layers=num_layers, topk=topk)
            except ValueError as exc:
                raise EngineError(client.url, "/generate", f"probe sequence {j}: {exc}", retryable=False) from exc
            routes = routes[: len(probe) - 1]
        runs.append(ProbeRun([float(e[0]) for e in entries[1:]], routes))
    return runs


def probe_logprobs(client: EngineClient, probe_ids: Sequence[int]) -> list[float]:
    """The engine's log p(probe[i] | probe[:i]) for i >= 1 of one probe sequence (see run_probes)."""
    return run_probes(client, [probe_ids])[0].logprobs


def uncovered_experts(runs: Iterable[ProbeRun], num_experts: int,
                      moe_layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """(layer, expert) pairs that no probe token was routed to; layers index the engine's layer axis (all of them
    when moe_layers is None, e.g. skip the dense first layers of DeepSeek-V3)."""
    seen: np.ndarray | None = None
    for run in runs:
        routes = run.routes
        if routes is None:
            raise ValueError("uncovered_experts needs probe runs with routes (run_probes(num_layers=, topk=))")
        if seen is None:
            seen = np.zeros((routes.shape[1], num_experts), dtype=bool)
        flat = routes.transpose(1, 0, 2).reshape(routes.shape[1], -1)  # [layers, tokens * top_k]
        valid = (flat >= 0) & (flat < num_experts)
        layer_index = np.broadcast_to(np.arange(flat.shape[0])[:, None], flat.shape)
        seen[layer_index[valid], flat[valid]] = True
    if seen is None:
        return []
    layers = range(seen.shape[0]) if moe_layers is None else moe_layers
    return [(layer, expert) for layer in layers for expert in range(num_experts) if not seen[layer, expert]]


@dataclass(frozen=True)
class ProbeCoverage:
    """How covering_probes extends a probe until every expert of every MoE layer is routed to at least once.

    Attributes:
        num_experts: routed experts per MoE layer.
        num_layers: layers on the engine's routed-experts axis (SGLang: all hidden layers).
        topk: experts per token.
        vocab_size: extension tokens are drawn from [1, vocab_size).
        moe_layers: the layers to cover (None: all); dense layers report no real routing.
        tokens_per_sequence: length of each added sequence (long enough that attention mixes many contexts).
        max_sequences: the bound on the probe (base sequences included); reaching it without coverage is an error.
        seed: seeds the added sequences (sequence k is the same on every call, so probes are reproducible).
    """

    num_experts: int
    num_layers: int
    topk: int
    vocab_size: int
    moe_layers: tuple[int, ...] | None = None
    tokens_per_sequence: int = 64
    max_sequences: int = 64
    seed: int = 0

    def extension(self, k: int) -> list[int]:
        """The k-th added sequence: tokens drawn uniformly from [1, vocab_size), independent of the schedule."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        return torch.randint(1, self.vocab_size, (self.tokens_per_sequence,), generator=generator).tolist()


def covering_probes(client: EngineClient, base: Sequence[Sequence[int]], coverage: ProbeCoverage) -> list[list[int]]:
    """The base probe sequences, extended with deterministic pseudo-random sequences until the engine's own routed
    experts touch every (MoE layer, expert): a stale expert then changes the log-prob of some probe token. Each
    round doubles the probe (one batched /generate per round). Raises EngineError naming the engine and the first
    uncovered pairs when max_sequences are not enough."""
    probes = [list(p) for p in base]
    if not probes:
        probes = [coverage.extension(0)]
    runs = run_probes(client, probes, num_layers=coverage.num_layers, topk=coverage.topk)
    missing = uncovered_experts(runs, coverage.num_experts, coverage.moe_layers)
    added = 0
    while missing:
        room = coverage.max_sequences - len(probes)
        if room <= 0:
            shown = ", ".join(f"layer {layer} expert {expert}" for layer, expert in missing[:5])
            raise EngineError(client.url, "/generate", f"probe of {len(probes)} sequences "
                              f"({sum(map(len, probes))} tokens) leaves {len(missing)} (layer, expert) pairs never "
                              f"routed to ({shown}{', ...' if len(missing) > 5 else ''}); raise "
                              f"ProbeCoverage.max_sequences (now {coverage.max_sequences})", retryable=False)
        new = [coverage.extension(added + 1 + i) for i in range(min(len(probes), room))]
        added += len(new)
        runs += run_probes(client, new, num_layers=coverage.num_layers, topk=coverage.topk)
        probes += new
        missing = uncovered_experts(runs, coverage.num_experts, coverage.moe_layers)
    return probes
