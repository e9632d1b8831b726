"""The "cuda_ipc" transport (see mpo.weight_sync; GPU only): no bytes over a link."""

from __future__ import annotations

import torch

from mpo.rollout.client import EngineError
from mpo.weight_sync.transports import TRANSPORTS, NamedTensors, PendingPush, Transport
from mpo.weight_sync.wire import SGLANG_FORMAT, cuda_ipc_payload


@TRANSPORTS.register("cuda_ipc")
class CudaIpcTransport(Transport):
    what = "SGLang's colocated GPU path"
    engines = ("sglang",)
    same_host = ("sglang",)
    call_unit = "IPC handles"

    def push(self, bucket: NamedTensors, version: str, *, wait: bool) -> PendingPush | None:
        """The bucket stays on this GPU and the engine maps it through CUDA IPC handles (torch's ForkingPickler
        reductions, as sglang's MultiprocessingSerializer writes them), one payload per engine TP rank. NOT RUN ON
        CPU (no CUDA here): GPU-only, checked on the lent GPU machine when there is one. The engines must run on this
        node's GPUs; the tensors stay alive until every engine replied."""
        session = self.session
        if not torch.cuda.is_available():
            raise EngineError(session.clients[0].url, "/update_weights_from_tensor",
                              "sync.transport='cuda_ipc' needs CUDA (colocated engines on the trainer's GPUs)",
                              retryable=False)
        device = torch.device("cuda", torch.cuda.current_device())
        on_device = [(name, t.detach().to(device)) for name, t in bucket]
        payload = cuda_ipc_payload(on_device)
        torch.cuda.synchronize(device)  # the packed buffer is written before the engines map it
        for client, tp in session.pushed():
            client.update_weights_from_tensor([payload] * tp, load_format=SGLANG_FORMAT, weight_version=version)
        torch.cuda.synchronize(device)
        return None
