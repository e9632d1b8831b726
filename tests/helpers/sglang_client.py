"""Raw HTTP client pieces for the real-SGLang tests, written without importing sglang (the main venv has none).

The weight-update wire pieces (`join_weight_update_group`, `flatten_bucket`, `serialize_for_sglang`) are production
code in `mpo.weight_sync.wire`; they are re-exported here so tests can speak the raw protocol with them.
"""
from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np

from mpo.weight_sync.wire import flatten_bucket, join_weight_update_group, serialize_for_sglang

__all__ = ["decode_routed_experts", "flatten_bucket", "http_json", "join_weight_update_group", "serialize_for_sglang"]


def http_json(url: str, payload: dict | None = None, headers: dict[str, str] | None = None,
              timeout: float = 120.0) -> tuple[int, dict]:
    """POST `payload` as JSON (GET when None); return (HTTP status, decoded body). Error statuses do not raise."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {"raw": body.decode(errors="replace")}


def decode_routed_experts(b64: str, num_layers: int, top_k: int) -> np.ndarray:
    """mpo's wire-format decoder, with the row count taken from the payload size."""
    from mpo.rollout.protocol import decode_routed_experts as decode

    rows = len(base64.b64decode(b64)) // (4 * num_layers * top_k)
    return decode(b64, rows=rows, num_layers=num_layers, topk=top_k)
