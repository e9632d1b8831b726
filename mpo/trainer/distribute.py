"""A step's samples from rank 0 to the ranks that train on them (issue #31): each data-parallel rank receives only its
own share, each pipeline stage only its own MoE layers' routes.

At Qwen3-30B-A3B a step is ~55M tokens; broadcasting every sample (with every layer's routes) to every rank made each
rank receive and unpickle the whole batch. Here rank 0 sends each rank one pickle holding
* full samples for the ones its data-parallel rank trains on, with routes cut to its stage's layers, per-token fields
  as compact numpy arrays (ids int32, log-probs, advantages and loss mask float32: what the rows become anyway);
* for every other sample only what the split needs: its length (ids = :class:`Elsewhere`), prompt length, group and
  reward, so every rank still computes the same uniform row length, micro-batch counts and packing plans.

Which data-parallel rank trains on a sample is :func:`dp_owners`: the split Trainer.pass_microbatches makes
(mini-batch u = samples[u::updates]; round-robin within it for padded rows, mpo.trainer.rows; Karmarkar-Karp over
lengths with schedule.max_tokens_per_microbatch, mpo.trainer.packing). A rank that ever reads another rank's sample
fails loudly (Elsewhere raises), so the two cannot drift apart silently.

Rank 0 may first ask every rank to publish the weights again (Distributor.republish; mpo.weight_sync tells when).

Transport: point-to-point sends on the gloo object group (parallel.distributed_timeout_s: every rank waits there while
rank 0 generates), the same on GPU and CPU. Ranks with the same data-parallel rank and stage (tensor / context
parallel peers) get the same pickle, made once.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from mpo.trainer.rows import Elsewhere, Sample


def dp_owners(lengths: list[int], *, updates: int, dp_size: int, packed: bool) -> list[int]:
    """The data-parallel rank that trains on each sample (see the module docstring)."""
    from mpo.trainer.packing import karmarkar_karp

    owners = [0] * len(lengths)
    for u in range(updates):
        members = list(range(u, len(lengths), updates))
        if packed:
            for d, share in enumerate(karmarkar_karp([lengths[i] for i in members], dp_size)):
                for j in share:
                    owners[members[j]] = d
        else:
            for j, i in enumerate(members):
                owners[i] = j % dp_size
    return owners


def _array(values, dtype) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=dtype)


def route_slots(num_route_layers: int, layers: tuple[int, ...], *, num_layers: int, first_k_dense: int) -> list[int]:
    """Indices into an engine routes array's layer axis of megatron layer numbers `layers`. The engine's array holds
    every layer (SGLang: engine layer l = layer number l+1) or the MoE layers only (after the first_k_dense)."""
    offset = 1 if num_route_layers == num_layers else 1 + first_k_dense
    if num_route_layers not in (num_layers, num_layers - first_k_dense):
        raise ValueError(f"engine routes have {num_route_layers} layers; the model has {num_layers} "
                         f"({num_layers - first_k_dense} MoE)")
    return [layer - offset for layer in layers]


def share_for(samples: list[Sample], owners: list[int], dp_rank: int, layers: tuple[int, ...], *, num_layers: int,
              first_k_dense: int = 0) -> list[Sample]:
    """What data-parallel rank `dp_rank` with stage layers `layers` receives: its own samples whole (routes cut to
    `layers`), the others as lengths."""
    out = []
    for s, owner in zip(samples, owners):
        if owner != dp_rank:
            out.append(Sample(ids=Elsewhere(len(s.ids)), prompt_len=s.prompt_len, group=s.group, reward=s.reward))
            continue
        routes = None
        if s.routes is not None:
            slots = route_slots(s.routes.shape[1], layers, num_layers=num_layers, first_k_dense=first_k_dense)
            routes = np.ascontiguousarray(s.routes[:, slots])
        advantage = s.advantage if isinstance(s.advantage, (int, float)) else _array(s.advantage, np.float32)
        out.append(replace(s, ids=np.asarray(s.ids, dtype=np.int32), advantage=advantage, routes=routes,
                           route_layers=tuple(layers) if routes is not None else None,
                           rollout_logprobs=_array(s.rollout_logprobs, np.float32),
                           loss_mask=_array(s.loss_mask, np.float32),
                           versions=None))  # rank 0 keeps them (staleness, versions.jsonl); no one else reads them
    return out


class Distributor:
    """Rank 0's samples -> every rank's view (call on every rank; a collective on the object group).

    Args:
        group: the gloo group of every rank (ParallelContext.object_group).
        dp_rank: this rank's data-parallel rank.
        layers: the MoE layer numbers of this rank's pipeline stage (its routing hooks' layers).
        num_layers, first_k_dense: the model's layer count and dense first layers (to index the engine's routes).
    """

    def __init__(self, group, *, dp_rank: int, layers: tuple[int, ...], num_layers: int, first_k_dense: int = 0):
        self.group = group
        self.rank = dist.get_rank()
        self.me = (dp_rank, tuple(layers))
        self.num_layers, self.first_k_dense = num_layers, first_k_dense
        self.on_republish: Callable[[], None] | None = None  # this rank's side of a weight publish (republish())
        self.ranks: list = [None] * dist.get_world_size()  # every rank's (dp_rank, layers)
        dist.all_gather_object(self.ranks, self.me, group=self.group)

    def republish(self) -> None:
        """Rank 0, before it sends a step's samples: every rank (the others wait in _receive) publishes again."""
        for dst in range(1, dist.get_world_size()):
            dist.send(torch.tensor([-1], dtype=torch.int64), dst=dst, group=self.group)
        self.on_republish()

    def __call__(self, samples: list[Sample] | None, *, updates: int, dp_size: int, packed: bool) -> list[Sample]:
        if self.rank != 0:
            return self._receive()
        owners = dp_owners([len(s.ids) for s in samples], updates=min(updates, len(samples)) or 1, dp_size=dp_size,
                           packed=packed)
        made: dict[tuple, bytes] = {}
        pending = []
        for dst, key in enumerate(self.ranks):
            if dst == 0:
                continue
            if key not in made:
                made[key] = pickle.dumps(share_for(samples, owners, key[0], key[1], num_layers=self.num_layers,
                                                   first_k_dense=self.first_k_dense),
                                         protocol=pickle.HIGHEST_PROTOCOL)
            payload = torch.frombuffer(bytearray(made[key]), dtype=torch.uint8) if made[key] else \
                torch.empty(0, dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
            pending += [(dist.isend(size, dst=dst, group=self.group), size),
                        (dist.isend(payload, dst=dst, group=self.group), payload)]  # tensors live until sent
        mine = share_for(samples, owners, *self.me, num_layers=self.num_layers, first_k_dense=self.first_k_dense)
        for work, _ in pending:
            work.wait()
        return mine

    def _receive(self) -> list[Sample]:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=0, group=self.group)
        while int(size) < 0:  # rank 0 asks for a re-publish first (republish)
            self.on_republish()
            dist.recv(size, src=0, group=self.group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, src=0, group=self.group)
        return pickle.loads(memoryview(payload.numpy()))
