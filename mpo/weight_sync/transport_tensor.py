"""The "tensor" transport (see mpo.weight_sync). SGLang engines must share the trainer's node (their loader reads the
payload's tensors where the trainer put them); mpo's engine decodes the bytes wherever it runs."""

from __future__ import annotations

from mpo.weight_sync.transports import TRANSPORTS, NamedTensors, PendingPush, Transport
from mpo.weight_sync.wire import MPO_FORMAT, SGLANG_FORMAT, encode_mpo_bucket, flattened_bucket_payload


@TRANSPORTS.register("tensor")
class TensorTransport(Transport):
    what = "the HTTP-body path"
    engines = ("mpo", "sglang")
    same_host = ("sglang",)
    call_unit = "HTTP payloads"

    @classmethod
    def link_copies(cls, engines: int, tp: int, at_once: bool) -> float:
        # one payload per engine TP rank, base64 in the JSON body
        return engines * tp * 4 / 3

    def push(self, bucket: NamedTensors, version: str, *, wait: bool) -> PendingPush | None:
        if self.session.engine == "mpo":
            load_format, payload = MPO_FORMAT, encode_mpo_bucket(bucket)
        else:
            load_format, payload = SGLANG_FORMAT, flattened_bucket_payload(bucket)
        self.session._each(lambda client, tp: client.update_weights_from_tensor(
            [payload] * tp, load_format=load_format, weight_version=version), pushing=True)
        return None
