"""Per-node routing of a sync (see mpo.weight_sync): engines reached through a same-host transport ("shm" on CPU,
"cuda_ipc" on GPU, "tensor" for SGLang) colocated on several trainer nodes.

Each engine belongs to the node its URL names; each node with engines has a leader, its lowest trainer rank. A
stage's sender pushes each bucket itself to the engines of its own node, and hands the bucket (packed into ONE uint8
buffer, wire.pack_bucket: a small header, the manifest, the buffer) point to point to the leader of every other
node with engines, which pushes it to its node's engines over the same transport. No rank holds more than the
bucket in flight (the sender's packed copy, the leader's receive buffer: on CPU a shared-memory file the engines
read in place), every engine gets every bucket inside rank 0's session, and rank 0 still verifies every engine.

Which node a rank is on: `MPO_NODE_HOST` (the launcher sets it to the node's host, the host its engines' URLs
name: emulated clusters put several "nodes" on one machine); else an engine is on a rank's node when its URL's
host is this machine (mpo.parallel.ports.is_local_host).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

NODE_HOST_ENV = "MPO_NODE_HOST"
RELAY_TIMEOUT_S = 600.0  # a relayed bucket's longest wait (a sender's whole stage may come before it)
NamedTensors = list[tuple[str, torch.Tensor]]


def engines_on_this_node(urls: Sequence[str]) -> list[int]:
    """Indices of the engines whose URL names this rank's node (module docstring)."""
    from mpo.parallel.ports import is_local_host

    node = os.environ.get(NODE_HOST_ENV)
    hosts = [urlsplit(url).hostname or "" for url in urls]
    # host names compare case-blind (urlsplit lowers them)
    return [i for i, host in enumerate(hosts) if (host == node.lower() if node else is_local_host(host))]


@dataclass(frozen=True)
class Routes:
    """Where each sender's buckets go. `node_of_engine[i]`: the leader rank of engine i's node; `direct[s]`: the
    engines sender s pushes to itself (its own node's); `relays[s]`: the leaders s hands its buckets to."""

    node_of_engine: tuple[int, ...]
    direct: dict[int, tuple[int, ...]]
    relays: dict[int, tuple[int, ...]]

    @property
    def relayed(self) -> bool:
        return any(self.relays.values())


def plan_routes(claims: Sequence[Sequence[int]], senders: Sequence[int], engines: int) -> Routes:
    """Routes from each rank's claims (engines_on_this_node, all-gathered). Ranks claiming the same engines share a
    node; its leader is the lowest of them. ValueError (one line) for an engine no rank is next to."""
    leader = [next((rank for rank, mine in enumerate(claims) if i in mine), None) for i in range(engines)]
    missing = [i for i, lead in enumerate(leader) if lead is None]
    if missing:
        raise ValueError(f"engine(s) {missing} are on no trainer node: a same-host sync.transport reaches only engines "
                         f"on the trainer's nodes; set sync.transport='distributed' (or 'tensor' for mpo engines)")
    direct = {s: tuple(i for i in range(engines) if i in claims[s]) for s in senders}
    relays = {s: tuple(sorted({lead for i, lead in enumerate(leader) if i not in claims[s]})) for s in senders}
    return Routes(tuple(leader), direct, relays)  # type: ignore[arg-type]


class NodeRelay:
    """One sync's relays on one rank (collective to make: every rank of the trainer world, same routes).

    A sender's `push(bucket)` pushes to its own node's engines through `direct` (a WeightSync limited to them, or
    None) and sends the bucket to every other node's leader; a leader receives, in a thread per remote sender, as
    many buckets as that sender has (`buckets_of[s]`) and pushes each through `leader_push`; then `finish()`.
    """

    def __init__(self, routes: Routes, *, rank: int, buckets_of: dict[int, int], group, device: torch.device,
                 direct: Callable[[NamedTensors], Any] | None, leader_push: Callable[[NamedTensors], None] | None,
                 shared: bool) -> None:
        self.routes, self.rank, self.group, self.device = routes, rank, group, device
        self.direct, self.leader_push, self.shared = direct, leader_push, shared
        self.relayed = 0  # buckets this rank pushed for another node's sender (a leader's count)
        self._sends: list = []  # the previous bucket's sends (and its packed buffer), waited before the next
        self._errors: list[BaseException] = []
        self._threads = []
        if leader_push is not None:
            for sender, leaders in routes.relays.items():
                if rank in leaders and buckets_of.get(sender):
                    thread = threading.Thread(target=self._receive, args=(sender, buckets_of[sender]), daemon=True,
                                              name=f"mpo-relay-from-{sender}")
                    thread.start()
                    self._threads.append(thread)

    # -- sender side -----------------------------------------------------------------------------------------------
    def push(self, bucket: NamedTensors) -> Any:
        """This sender's bucket to its node's engines (returns the direct push's ticket) and to every other node."""
        from mpo.weight_sync.wire import dtype_name, pack_bucket

        leaders = self.routes.relays.get(self.rank, ())
        if leaders:
            self._wait_sends()  # at most one bucket of relays in flight: memory stays one packed copy
            flat, manifest = pack_bucket(bucket, device=self.device)
            entries = [{"name": m.name, "dtype": dtype_name(m.dtype), "shape": list(m.shape)} for m in manifest]
            # a small header: the buffer's bytes and its manifest (offsets follow from the order: manifest_of)
            header = torch.frombuffer(bytearray(json.dumps({"n": int(flat.numel()), "m": entries}).encode()),
                                      dtype=torch.uint8)
            size = torch.tensor([header.numel()], dtype=torch.int64)
            works = [dist.isend(part, dst=leader, group=self.group)
                     for leader in leaders for part in (size, header, flat)]
            self._sends = [(works, (size, header, flat))]
        return self.direct(bucket) if self.direct is not None else None

    def _wait_sends(self) -> None:
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends = []

    # -- leader side -----------------------------------------------------------------------------------------------
    def _receive(self, sender: int, count: int) -> None:
        from mpo.weight_sync.wire import dtype_from_name, manifest_of, unpack_bucket

        buffer = None
        try:
            for _ in range(count):
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, src=sender, group=self.group)
                raw = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(raw, src=sender, group=self.group)
                header = json.loads(bytes(raw.numpy()).decode())
                if buffer is None or buffer.numel < header["n"]:
                    buffer = self._buffer(sender, header["n"], buffer)
                flat = buffer.tensor[: header["n"]]
                dist.recv(flat, src=sender, group=self.group)
                manifest, _ = manifest_of([(m["name"], dtype_from_name(m["dtype"]), m["shape"]) for m in header["m"]])
                self.leader_push(unpack_bucket(flat, manifest))  # waits until the engines read it
                self.relayed += 1
        except BaseException as exc:  # noqa: BLE001 - raised by finish() in the caller's thread
            self._errors.append(exc)
        finally:
            if buffer is not None:
                buffer.close()

    def _buffer(self, sender: int, nbytes: int, old):
        """The leader's receive buffer for `sender`: a shared-memory file on CPU (the node's mpo engines read the
        bucket in place, shm transport), else a plain tensor on the training device."""
        if old is not None:
            old.close()
        if self.shared:
            from mpo.weight_sync.shared_memory import SharedBuffer, file_name, new_token

            return SharedBuffer(file_name(new_token(), "relay", sender), nbytes, torch.uint8, create=True)
        return _Plain(torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    def finish(self, timeout_s: float) -> None:
        """Wait for every relay send and receive of this sync; raise the first error."""
        self._wait_sends()
        for thread in self._threads:
            thread.join(timeout_s)
        if any(thread.is_alive() for thread in self._threads):
            raise TimeoutError(f"relayed buckets did not all arrive within {timeout_s:.0f} s")
        if self._errors:
            raise self._errors[0]


class _Plain:
    """A device tensor with SharedBuffer's face (numel, tensor, close)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.numel = tensor, tensor.numel()

    def close(self) -> None:
        self.tensor = None


def relay_group(timeout_s: float, backend: str):
    """Collective: the process group relays travel on (its own, so they never match the stream's point-to-point
    messages, and a leader's receive thread does not share a communicator with its main thread)."""
    return dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
