"""mpo's binary /generate answer: a JSON header plus raw array bytes, so routes travel as their compact bytes (uint8
[tokens, MoE layers, top_k] at up to 256 experts) instead of base64 int32 inside JSON (about 5.3x more bytes, and a
string rank 0 must parse and decode).

A client asks for it with ``Accept: application/x-mpo-frames``; mpo's engine then answers with that content type,
and everything else (real SGLang, any other answer) stays SGLang's JSON, which the client decodes once into the same
compact arrays (mpo.rollout.protocol.GenerateResult.from_json). Layout of a frames body::

    b"MPOF1\\n" | u64 little-endian header length | header (UTF-8 JSON) | array bytes, end to end

The header is ``{"payload": ..., "arrays": [[dtype, shape, offset, nbytes], ...]}``: the JSON answer with each numpy
array replaced by ``{"__array__": [index, start, stop]}``, rows start:stop of table array `index`: the arrays of one
dtype and row shape (a batch answer's output ids, log-probs, routes) travel as one array each, not three per row (the
decoding's cost is per array). ``{"__array__": index}`` names a whole array (0-d arrays travel so).
"""

from __future__ import annotations

import functools
import json
import math
import reprlib
import struct
from typing import Any

import numpy as np

from mpo.rollout.protocol import encode_routed_experts

# A value of a malformed header in an error message: cut short (it may be huge, or nested too deep for repr).
_short = reprlib.Repr(maxlevel=2, maxlist=4, maxdict=4, maxstring=40, maxother=40).repr

CONTENT_TYPE = "application/x-mpo-frames"
MAGIC = b"MPOF1\n"
_LENGTH = struct.Struct("<Q")
_DTYPES = {"uint8", "int16", "int32", "int64", "float32", "float64"}


def encode_frames(payload: Any) -> bytes:
    """`payload` (JSON values and numpy arrays) -> a frames body."""
    arrays: list[tuple[np.ndarray, dict]] = []  # every array of the payload, with the reference that replaces it

    def strip(value: Any) -> Any:
        # Only containers are visited: a 128-row answer holds ~3,000 scalars (per-token versions, finish reasons),
        # and a call per scalar was most of the encoding's time.
        kind = type(value)
        if kind is dict:
            return {k: strip(v) if type(v) in _NESTED else v for k, v in value.items()}
        if kind is list or kind is tuple:
            return [strip(v) if type(v) in _NESTED else v for v in value]
        if kind is np.ndarray:
            reference: dict = {"__array__": None}  # filled once the arrays are grouped into columns
            arrays.append((value, reference))
            return reference
        if isinstance(value, dict):  # subclasses take the slow road
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        if isinstance(value, np.ndarray):
            return strip(np.asarray(value))
        return value

    stripped = strip(payload)
    columns: dict[tuple, list[tuple[np.ndarray, dict]]] = {}  # (dtype, row shape) -> its arrays, in payload order
    for array, reference in arrays:
        little = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        key = (_dtype_name(little), array.shape[1:]) if array.ndim else (_dtype_name(little), None, len(columns))
        columns.setdefault(key, []).append((array.astype(little, copy=False), reference))
    table, blobs, offset = [], [], 0
    for key, members in columns.items():
        if key[1] is None:  # a 0-d array: whole (np.ascontiguousarray would make it 1-d)
            column = members[0][0].copy(order="C")
            members[0][1]["__array__"] = len(table)
        else:
            column = np.concatenate([array for array, _ in members]) if len(members) > 1 else \
                np.ascontiguousarray(members[0][0])
            row = 0
            for array, reference in members:
                reference["__array__"] = [len(table), row, row + len(array)]
                row += len(array)
        table.append([key[0], list(column.shape), offset, column.nbytes])
        blobs.append(column.tobytes())
        offset += column.nbytes
    header = json.dumps({"payload": stripped, "arrays": table}).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(header)), header, *blobs])


_NESTED = frozenset({dict, list, tuple, np.ndarray})  # the types strip and restore descend into


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # numpy builds the name string on every access (2.5 us): once per dtype


@functools.lru_cache(maxsize=None)
def _little_endian(name: str) -> np.dtype:
    return np.dtype(name).newbyteorder("<")


def decode_frames(body: bytes) -> Any:
    """A frames body -> the payload with its numpy arrays (views of `body`, read-only). ValueError when malformed,
    also when its header nests deeper than the interpreter's stack (json.loads, restore and repr recurse)."""
    try:
        return _decode_frames(body)
    except RecursionError:
        raise ValueError("frames header nests deeper than Python's recursion limit") from None


def _decode_frames(body: bytes) -> Any:
    if not body.startswith(MAGIC) or len(body) < len(MAGIC) + _LENGTH.size:
        raise ValueError("not an mpo frames body (bad magic)")
    start = len(MAGIC) + _LENGTH.size
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    if start + length > len(body):
        raise ValueError(f"frames header of {length} bytes runs past the body's {len(body)}")
    header = json.loads(body[start:start + length])  # json's ValueError names the position
    malformed = "frames header is not {\"payload\": ..., \"arrays\": [[dtype, shape, offset, nbytes], ...]}"
    if not (isinstance(header, dict) and "payload" in header and isinstance(header.get("arrays"), list)):
        raise ValueError(malformed)
    data = memoryview(body)[start + length:]
    arrays = []
    for row in header["arrays"]:
        if not (isinstance(row, list) and len(row) == 4 and type(row[0]) is str and type(row[2]) is int
                and type(row[3]) is int):
            raise ValueError(malformed)
        dtype, shape, offset, nbytes = row
        if dtype not in _DTYPES:
            raise ValueError(f"frames array dtype {_short(dtype)}; valid: {sorted(_DTYPES)}")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"frames array shape {_short(shape)} is not a list of sizes")
        dt = _little_endian(dtype)
        if offset < 0 or offset + nbytes > len(data) or nbytes != math.prod(shape) * dt.itemsize:
            raise ValueError(f"frames array {dtype}{shape} at {offset}+{nbytes} does not fit the body")
        arrays.append(np.frombuffer(data, dtype=dt, count=nbytes // dt.itemsize, offset=offset).reshape(shape))

    def restore(value: Any) -> Any:  # json.loads made only dicts and lists; only those are visited
        if type(value) is dict:
            if len(value) == 1 and "__array__" in value:
                where = value["__array__"]
                if type(where) is int and 0 <= where < len(arrays):
                    return arrays[where]
                if (type(where) is list and len(where) == 3 and all(type(n) is int for n in where)
                        and 0 <= where[0] < len(arrays) and arrays[where[0]].ndim
                        and 0 <= where[1] <= where[2] <= len(arrays[where[0]])):
                    return arrays[where[0]][where[1]:where[2]]
                raise ValueError(f"frames payload names array {_short(where)}; the body has {len(arrays)}")
            return {k: restore(v) if type(v) in _NESTED else v for k, v in value.items()}
        return [restore(v) if type(v) in _NESTED else v for v in value]

    payload = header["payload"]
    return restore(payload) if type(payload) in _NESTED else payload


def frames_answer(payload: Any) -> Any:
    """A /generate answer (one dict or a list of them) with its per-token lists as arrays for the frames body:
    output_ids int64 [n], output_token_logprobs float64 [n] (the log-probs of SGLang's [logprob, id, text] triples;
    the ids are output_ids). Anything else passes unchanged."""
    if isinstance(payload, list):
        return _share_prompt_routes([frames_answer(p) for p in payload])
    if not isinstance(payload, dict) or not isinstance(payload.get("meta_info"), dict):
        return payload
    meta = dict(payload["meta_info"])
    triples = meta.get("output_token_logprobs")
    if isinstance(triples, list):
        meta["output_token_logprobs"] = np.array([t[0] for t in triples], dtype=np.float64)
    out = {**payload, "meta_info": meta}
    if isinstance(payload.get("output_ids"), list):
        out["output_ids"] = np.array(payload["output_ids"], dtype=np.int64)
    return out


def _share_prompt_routes(answers: list) -> list:
    """A call's samples of one prompt are prefilled alike, so their routes over the prompt's positions (the first
    `prompt_tokens` rows) repeat. Where a sample's are byte for byte those of an earlier sample of the call, it sends
    only its rows after them and names that sample (`routed_experts_prompt_from`): at G samples per prompt the
    prompt's routes travel once, not G times, and restore_prompt_routes rebuilds them exactly."""
    first: dict[tuple, int] = {}  # (dtype, prompt rows' bytes) -> the first answer carrying them
    out = []
    for i, answer in enumerate(answers):
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        routes = meta.get("routed_experts") if isinstance(meta, dict) else None
        rows = meta.get("prompt_tokens") if isinstance(routes, np.ndarray) else None
        if isinstance(rows, int) and 0 < rows <= len(routes):
            j = first.setdefault((routes.dtype.str, routes[:rows].tobytes()), i)
            if j != i:
                answer = {**answer, "meta_info": {**meta, "routed_experts": routes[rows:],
                                                  "routed_experts_prompt_from": j}}
        out.append(answer)
    return out


def restore_prompt_routes(payload: Any) -> Any:
    """The inverse of _share_prompt_routes on a decoded frames answer; ValueError for a reference that is not to an
    earlier answer holding its own prompt routes."""
    if not isinstance(payload, list):
        return payload
    for i, answer in enumerate(payload):
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if not isinstance(meta, dict) or "routed_experts_prompt_from" not in meta:
            continue
        j, rows = meta.pop("routed_experts_prompt_from"), meta.get("prompt_tokens")
        earlier = payload[j] if type(j) is int and 0 <= j < i else None
        source = earlier.get("meta_info") if isinstance(earlier, dict) else None
        source = source if isinstance(source, dict) else {}  # any other shape names no routes: the error below
        prompt = source.get("routed_experts")
        if ("routed_experts_prompt_from" in source or not isinstance(prompt, np.ndarray) or not prompt.ndim
                or type(rows) is not int or not 0 < rows <= len(prompt)
                or not isinstance(meta.get("routed_experts"), np.ndarray)):
            raise ValueError(f"answer {i}: routed_experts_prompt_from={_short(j)} names no earlier answer's prompt "
                             "routes")
        meta["routed_experts"] = np.concatenate([prompt[:rows], meta["routed_experts"]])
    return payload


def sglang_json(payload: Any) -> Any:
    """The same answer as SGLang's JSON: routes (``meta_info.routed_experts`` arrays) as base64 little-endian int32,
    any other array as a list."""

    def convert(value: Any, key: str | None = None) -> Any:
        if isinstance(value, np.ndarray):
            return encode_routed_experts(value) if key == "routed_experts" else value.tolist()
        if isinstance(value, dict):
            return {k: convert(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return convert(payload)


def wants_frames(accept: str | None) -> bool:
    return bool(accept) and CONTENT_TYPE in accept
