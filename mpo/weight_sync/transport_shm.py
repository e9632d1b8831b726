"""The "shm" transport (see mpo.weight_sync; CPU, mpo engines on the trainer's host); slots: shared_memory.py."""

from __future__ import annotations

import json

import torch

from mpo.weight_sync.transports import TRANSPORTS, NamedTensors, PendingPush, Transport, _Calls
from mpo.weight_sync.wire import SHM_FORMAT


@TRANSPORTS.register("shm")
class ShmTransport(Transport):
    what = "mpo's engine's same-host path"
    engines = ("mpo",)
    same_host = ("mpo",)
    in_place = True
    call_unit = "locator messages"

    def __init__(self, session) -> None:
        super().__init__(session)
        self._spill = None  # shared buffer for tensors that are not in a shared slot already

    def push(self, bucket: NamedTensors, version: str, *, wait: bool) -> PendingPush | None:
        """Same-host mpo engines read the bucket in place: locators for tensors already in a shared slot (strided
        views included: the streaming sync's q/k/v), one copy into the spill buffer for the rest (a plain list of
        tensors, as the benches push). A bucket that needed the spill buffer is always waited for (the buffer is
        reused by the next bucket)."""
        from mpo.weight_sync.shared_memory import SharedBuffer, file_name, locate, new_token

        session = self.session
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
                self._spill = SharedBuffer(file_name(new_token(), "spill"), max(sum(sizes), session.bucket_bytes),
                                           torch.uint8, create=True)
            at = 0
            for (name, tensor), size in zip(missing, sizes):
                nbytes = tensor.numel() * tensor.element_size()
                view = self._spill.tensor[at: at + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)
                located.append(locate(name, view))
                at += size
        payload = json.dumps([loc.to_json() for loc in located])
        live = session.pushed()
        tp_of = {id(c): tp for c, tp in live}
        pending = PendingPush(_Calls([c for c, _ in live], lambda client: client.update_weights_from_tensor(
            [payload] * tp_of[id(client)], load_format=SHM_FORMAT, weight_version=version)), session.timeout_s,
            session._drop)
        if wait or missing:
            pending.wait()
            return None
        return pending

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
