"""SGLang's /generate wire format (sglang 0.5.23), in one place: the shapes its /generate route takes and returns.

Both engines behind the API (real SGLang and mpo's own) produce and consume exactly these shapes:
- request: {"input_ids": [...], "sampling_params": {...}, "return_logprob": true, "return_routed_experts": true}
- response meta_info.output_token_logprobs: [[logprob, token_id, null], ...], one per generated token
- response meta_info.routed_experts: base64 of little-endian int32, logical shape [prompt+completion-1, layers, top_k];
  row i is the routing of the token at input position i (the last token is never an input, so it has no row)
"""

from __future__ import annotations

import base64
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


# Temperatures below this sample greedily, as in SGLang (its _SAMPLING_EPS): dividing logits by a tiny positive
# temperature overflows (1e-320 gives inf/NaN probabilities), and the limit of sampling as T -> 0 is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-6
# Per-request seeds feed torch.Generator.manual_seed; keep them in the range every engine accepts.
MAX_SAMPLING_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """The sampling_params fields an RL rollout uses. Construction validates every field (check_sampling_fields).

    Attributes:
        temperature: 0 (or anything below GREEDY_BELOW_TEMPERATURE) means greedy.
        top_p: nucleus sampling mass, in (0, 1].
        top_k: keep only the k most likely tokens; -1 keeps all (SGLang's convention).
        max_new_tokens: generation budget, >= 1; an engine also caps it by its context length minus the prompt.
        stop_token_ids: generation ends after emitting any of these.
        sampling_seed: per-request seed for reproducible sampling (None: engine's own stream).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    top_k: int = -1

    def __post_init__(self) -> None:
        # vars, not dataclasses.asdict: that deep-copies every value, per request on both sides of every /generate
        check_sampling_fields(vars(self), where="sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def to_json(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is None:
            del out["sampling_seed"]
        return out

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "sampling_params") -> "SamplingParams":
        """Parse a wire `sampling_params` object; ValueError naming the field (`where`.field) if anything is wrong.
        Fields mpo does not use (SGLang has many) are ignored."""
        obj = {} if obj is None else obj
        if not isinstance(obj, dict):
            raise ValueError(f"{where} must be a JSON object, got {_json_type(obj)}")
        known = {k: obj[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "sampling_seed")
                 if obj.get(k) is not None}
        try:  # construction checks every field (once: a /generate of 128 rows parses 128 of these, on both sides)
            return cls(**known, stop_token_ids=tuple(obj.get("stop_token_ids") or ()))
        except (TypeError, ValueError):
            check_sampling_fields(obj, where=where)  # the same check on the wire object: the message names `where`
            raise


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             tuple: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def is_json_int(value: Any) -> bool:
    """An integer as JSON means it: not a boolean (bool is an int in Python) and not a float like 5.7."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# (field, is the value valid, what it must be): checked in this order, each only when given
_SAMPLING_RULES = (
    ("temperature", lambda t: _is_number(t) and math.isfinite(t) and t >= 0,
     f"a finite number >= 0 (below {GREEDY_BELOW_TEMPERATURE:g} means greedy)"),
    ("top_p", lambda p: _is_number(p) and math.isfinite(p) and 0 < p <= 1, "a number in (0, 1]"),
    ("top_k", lambda k: is_json_int(k) and (k == -1 or k >= 1), "an integer >= 1, or -1 for no limit"),
    ("max_new_tokens", lambda n: is_json_int(n) and n >= 1, "an integer >= 1"),
    ("sampling_seed", lambda s: is_json_int(s) and 0 <= s <= MAX_SAMPLING_SEED,
     f"an integer in [0, {MAX_SAMPLING_SEED}]"),
    ("stop_token_ids", lambda ids: isinstance(ids, (list, tuple)) and all(is_json_int(i) and i >= 0 for i in ids),
     "a list of integers >= 0"))


def check_sampling_fields(values: dict[str, Any], *, where: str) -> None:
    """The one validator of sampling parameters (engine server, client, SamplingParams): types (integers are not
    booleans or floats), finiteness and ranges. Absent or null fields take their defaults and are not checked.
    Raises ValueError "<where>.<field>=<value> must ...", naming the field and its valid values."""
    for name, valid, rule in _SAMPLING_RULES:
        if values.get(name) is not None and not valid(values[name]):
            raise ValueError(f"{where}.{name}={values[name]!r} must be {rule}")


def check_token_ids(ids: Any, *, where: str, vocab_size: int | None = None) -> list[int]:
    """A non-empty list of token ids (integers, not booleans or floats; inside the vocabulary when it is known)."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{where} must be a non-empty list of token ids, got {_json_type(ids)}"
                         f"{' (empty)' if isinstance(ids, (list, tuple)) else ''}")
    for i, token in enumerate(ids):
        if not is_json_int(token):
            raise ValueError(f"{where}[{i}]={token!r} must be an integer token id, got {_json_type(token)}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{where}[{i}]={token} is outside the vocabulary {limit}")
    return list(ids)


def check_context_budget(prompt_tokens: int, max_new_tokens: int, context_length: int, *, row: int | None = None,
                         ) -> None:
    """prompt + completion must fit the model's context length (positions past it do not exist): like SGLang, a
    request that asks for more is refused rather than silently cut. `row`: the row of a batch, for the message."""
    where = "" if row is None else f"[{row}]"
    if prompt_tokens >= context_length:
        raise ValueError(f"input_ids{where} has {prompt_tokens} tokens; the model's context length is "
                         f"{context_length}, which leaves no room for a new token")
    if prompt_tokens + max_new_tokens > context_length:
        raise ValueError(f"sampling_params{where}.max_new_tokens={max_new_tokens} must be at most "
                         f"{context_length - prompt_tokens}: the model's context length {context_length} minus the "
                         f"prompt's {prompt_tokens} tokens")


@dataclass(frozen=True)
class ParsedGenerate:
    """A validated /generate request body: one or more rows, each with its own sampling parameters."""

    rows: list[list[int]]
    sampling: list[SamplingParams]
    batch: bool  # the body used the batch form (input_ids: list of lists): answer with a list
    rids: list[str] | None
    return_logprob: bool
    return_routed_experts: bool
    routed_experts_start_len: int = 0  # SGLang 0.5.23's field: routes of positions [start, n-1) only


def parse_generate_request(body: Any, *, vocab_size: int | None = None,
                           context_length: int | None = None) -> ParsedGenerate:
    """Validate a /generate body (SGLang's GenerateReqInput, the subset mpo serves); ValueError naming the field.

    The mpo engine calls it before anything is queued, so one bad request is refused alone (HTTP 400) and never
    reaches a batch; EngineClient calls it before sending, so a bad request fails in the caller with the same message.
    """
    if not isinstance(body, dict):
        raise ValueError(f"the /generate body must be a JSON object, got {_json_type(body)}")
    if "input_ids" not in body:
        raise ValueError("input_ids is required (token ids; mpo sends no text)")
    ids = body["input_ids"]
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], (list, tuple))
    rows = ([check_token_ids(row, where=f"input_ids[{i}]", vocab_size=vocab_size) for i, row in enumerate(ids)]
            if batch else [check_token_ids(ids, where="input_ids", vocab_size=vocab_size)])
    params = body.get("sampling_params")
    if isinstance(params, list):
        if not batch or len(params) != len(rows):
            raise ValueError(f"sampling_params is a list of {len(params)}; a list needs the batch form of input_ids "
                             f"with as many rows ({len(rows)} given{'' if batch else ', not a batch'})")
        sampling = [SamplingParams.from_json(p, where=f"sampling_params[{i}]") for i, p in enumerate(params)]
    else:
        sampling = [SamplingParams.from_json(params)] * len(rows)
    if context_length is not None:
        for i, (row, params_i) in enumerate(zip(rows, sampling)):
            check_context_budget(len(row), params_i.max_new_tokens, context_length, row=i if batch else None)
    rid = body.get("rid")
    if rid is None:
        rids = None
    elif isinstance(rid, str):
        rids = [f"{rid}-{i}" for i in range(len(rows))] if batch else [rid]
    elif batch and isinstance(rid, list) and len(rid) == len(rows) and all(isinstance(r, str) for r in rid):
        rids = list(rid)
    else:
        raise ValueError(f"rid must be a string{' or a list of one string per row' if batch else ''}, got "
                         f"{_json_type(rid)}")
    flags = {}
    for flag in ("return_logprob", "return_routed_experts"):
        value = body.get(flag)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{flag}={value!r} must be true or false")
        flags[flag] = bool(value)
    start = body.get("routed_experts_start_len", 0)
    if not is_json_int(start) or not 0 <= start <= min(map(len, rows)):
        raise ValueError(f"routed_experts_start_len={start!r} must be an integer in [0, {min(map(len, rows))}] (the "
                         f"shortest row's prompt tokens)")
    return ParsedGenerate(rows, sampling, batch, rids, **flags, routed_experts_start_len=int(start))


@dataclass(frozen=True)
class GenerateRequest:
    """One rollout request (one prompt, one sample)."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    return_logprob: bool = True
    return_routed_experts: bool = False
    rid: str | None = None
    routed_experts_start_len: int = 0  # routes of positions [start, n-1) only (the rest: another sample's prompt)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": list(self.input_ids), "sampling_params": self.sampling.to_json(),
                                "return_logprob": self.return_logprob}
        if self.return_routed_experts:
            body["return_routed_experts"] = True
            if self.routed_experts_start_len:
                body["routed_experts_start_len"] = self.routed_experts_start_len
        if self.rid is not None:
            body["rid"] = self.rid
        return body


@dataclass
class GenerateResult:
    """A parsed /generate response."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: int | None = None  # the engine's, as mpo's int (weight_version())
    # [prompt+completion-1, MoE layers, top_k], compact_routes' dtype (rows from routed_experts_start_len on, when
    # the request set it: EngineClient.generate_batch puts the prompt's rows back)
    routed_experts: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    @classmethod
    def from_json(cls, request: GenerateRequest, obj: Any, *, num_layers: int | None = None,
                  topk: int | None = None, num_experts: int | None = None) -> "GenerateResult":
        """Parse one answer (SGLang's JSON, or mpo's frames whose arrays are numpy already). Routes are decoded once
        into the compact array of :func:`compact_routes` (uint8 up to 256 experts).

        Every field mpo reads is type-checked here, where it is read: an answer of another shape (a list for an
        object, a string for a token id, a short triple) is a ValueError naming the field, which EngineClient turns
        into an engine failure, never an AttributeError or TypeError in the rollout pool or the trainer."""
        if not isinstance(obj, dict):
            raise ValueError(f"the answer must be a JSON object, got {_json_type(obj)}")
        meta = obj.get("meta_info")
        if meta is None:
            meta = {}
        elif not isinstance(meta, dict):
            raise ValueError(f"meta_info must be an object, got {_json_type(meta)}")
        output_ids = _answer_ids(obj.get("output_ids"))
        triples = meta.get("output_token_logprobs")
        triples = [] if triples is None else triples
        if request.return_logprob and _length(triples, "meta_info.output_token_logprobs") != len(output_ids):
            raise ValueError(f"output_token_logprobs has {len(triples)} entries for {len(output_ids)} output ids")
        routed = None
        if request.return_routed_experts:
            if num_layers is None or topk is None:
                raise ValueError("routed experts requested but the client does not know the model's num_layers and "
                                 "top_k (EngineClient(num_layers=..., topk=...))")
            if "routed_experts" not in meta:
                raise ValueError("response has no meta_info.routed_experts: was the engine started with "
                                 "--enable-return-routed-experts (and not behind a router that drops it)?")
            rows = len(request.input_ids) + len(output_ids) - 1 - request.routed_experts_start_len
            wire = meta["routed_experts"]
            if isinstance(wire, np.ndarray):  # mpo's frames: already compact, only checked
                if wire.shape != (rows, num_layers, topk) or wire.dtype.kind not in "iu":
                    raise ValueError(f"routed_experts has shape {wire.shape} ({wire.dtype}); expected integers of "
                                     f"rows={rows} x layers={num_layers} x top_k={topk}")
                # a writable copy of its own: the frames body it views is freed, torch can take it as is
                routed = np.array(compact_routes(wire, num_experts), copy=True)
            elif isinstance(wire, str):  # SGLang's base64 int32 JSON, decoded once into the compact array
                routed = compact_routes(decode_routed_experts(wire, rows=rows, num_layers=num_layers, topk=topk),
                                        num_experts)
            else:
                raise ValueError(f"meta_info.routed_experts must be a base64 string, got {_json_type(wire)}")
            meta = {k: v for k, v in meta.items() if k != "routed_experts"}  # one copy of the routes, not two
        finish = meta.get("finish_reason") or {}
        if not isinstance(finish, dict):
            raise ValueError(f"meta_info.finish_reason must be an object or null, got {_json_type(finish)}")
        latency = meta.get("e2e_latency")
        if latency is not None and not _is_number(latency):
            raise ValueError(f"meta_info.e2e_latency must be a number, got {_json_type(latency)}")
        if "loss_mask" in meta:  # mpo's own key (mpo.envs.rollout builds it), never an engine's to set
            meta = {k: v for k, v in meta.items() if k != "loss_mask"}
        stamps = meta.get("output_token_weight_versions")
        if stamps is None and meta.get("weight_versions") is not None:  # SGLang's spans, one stamp per token here
            stamps = span_versions(meta["weight_versions"], len(output_ids))
            meta = {**meta, "output_token_weight_versions": stamps}
        if stamps is not None:
            if _length(stamps, "meta_info.output_token_weight_versions") != len(output_ids):
                raise ValueError(f"output_token_weight_versions has {len(stamps)} entries for {len(output_ids)} "
                                 "output ids")
            meta = {**meta, "output_token_weight_versions": token_versions(stamps)}
        return cls(prompt_ids=list(request.input_ids), output_ids=output_ids, output_logprobs=_answer_logprobs(triples),
                   finish_reason=finish, weight_version=weight_version(meta.get("weight_version")),
                   routed_experts=routed, meta=meta)


def _length(value: Any, where: str) -> int:
    """len() of a per-token field of an answer: a JSON list, or a 1-d frames array."""
    if isinstance(value, list) or (isinstance(value, np.ndarray) and value.ndim == 1):
        return len(value)
    raise ValueError(f"{where} must be a list, got {_json_type(value)}"
                     f"{f' of shape {value.shape}' if isinstance(value, np.ndarray) else ''}")


def _answer_ids(ids: Any) -> list[int]:
    """An answer's output_ids (absent: none): a list of token ids >= 0, or the frames' 1-d integer array."""
    if ids is None:
        return []
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or (ids.size and int(ids.min()) < 0):
            raise ValueError(f"output_ids must be token ids >= 0, got an array {ids.dtype}{list(ids.shape)}")
        return ids.tolist()
    if not isinstance(ids, list):
        raise ValueError(f"output_ids must be a list of token ids, got {_json_type(ids)}")
    # type(), not isinstance: true is not a token; checked with C loops (map, min): a 128-row answer has ~30k ids
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0):
        i, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int or t < 0)
        raise ValueError(f"output_ids[{i}]={_short(bad)} must be a token id (an integer >= 0)")
    return list(ids)


def _answer_logprobs(triples: Any) -> list[float]:
    """meta_info.output_token_logprobs as floats: SGLang's [[logprob, token_id, text], ...] or the frames' 1-d float
    array of the log-probs."""
    if isinstance(triples, np.ndarray):
        if triples.ndim != 1 or triples.dtype.kind != "f":
            raise ValueError(f"meta_info.output_token_logprobs must be floats, got an array "
                             f"{triples.dtype}{list(triples.shape)}")
        return triples.astype(np.float64).tolist()
    if not isinstance(triples, list):
        raise ValueError(f"meta_info.output_token_logprobs must be a list, got {_json_type(triples)}")
    logprobs = [float(t[0]) for t in triples if type(t) is list and t and type(t[0]) in _LOGPROB_TYPES]
    if len(logprobs) != len(triples):
        i, bad = next((i, t) for i, t in enumerate(triples)
                      if type(t) is not list or not t or type(t[0]) not in _LOGPROB_TYPES)
        raise ValueError(f"meta_info.output_token_logprobs[{i}]={_short(bad)} must be [logprob, token_id, text]")
    return logprobs


_LOGPROB_TYPES = (float, int)  # type(), not isinstance: true is no log-prob


# A value of an engine's answer in an error message: cut short (a malformed answer may be huge or deeply nested).
_short = reprlib.Repr(maxlevel=2, maxlist=4, maxdict=4, maxstring=40, maxother=40).repr


def weight_version(stamp: Any) -> int | None:
    """An engine's weight-version stamp as mpo's version number: the trainer publishes str(int) (SGLang's
    weight_version is a string); another stamp ("default" before the first update) is None."""
    text = str(stamp) if isinstance(stamp, (int, np.integer, str)) and not isinstance(stamp, bool) else ""
    return int(text) if text.isascii() and text.isdigit() else None


def span_versions(spans: Any, count: int) -> list[Any]:
    """SGLang's meta_info.weight_versions ([{"version", "start", "end"}, ...] over the output tokens: the version
    each run of tokens was sampled under, a weight update in flight starting a new span) as one stamp per token;
    ValueError naming the field when it is not that."""
    if not isinstance(spans, list) or not all(isinstance(span, dict) for span in spans):
        raise ValueError(f"meta_info.weight_versions must be a list of spans, got {_short(spans)}")
    stamps: list[Any] = []
    for i, span in enumerate(spans):
        start, end = span.get("start"), span.get("end")
        if not (is_json_int(start) and is_json_int(end) and start == len(stamps) and start <= end <= count):
            raise ValueError(f"meta_info.weight_versions[{i}]={_short(span)} must cover the output tokens in order "
                             f"from {len(stamps)} (of {count})")
        stamps += [span.get("version")] * (end - start)
    return stamps + [None] * (count - len(stamps))  # none left: unknown, the collector's default


def token_versions(stamps: Any, default: int = -1, count: int = 0) -> np.ndarray:
    """Per-token weight-version stamps (meta_info.output_token_weight_versions; None or none: `count` unstamped
    tokens, as from SGLang) as int64, `default` where unknown; one weight_version() per distinct stamp."""
    if stamps is None or not len(stamps):
        return np.full(count, default, dtype=np.int64)
    if isinstance(stamps, np.ndarray) and stamps.dtype.kind in "iu":
        values = stamps.astype(np.int64)
    else:  # a JSON list: a response's tokens share one or two stamps (np.unique cost ~16 us per response)
        seen: dict[tuple[type, Any], int] = {}

        def version(stamp: Any) -> int:
            try:
                key = (type(stamp), stamp)
                known = seen.get(key)
            except TypeError:  # unhashable (a list or object): not a version
                return -1
            if known is None:
                known = seen[key] = -1 if (v := weight_version(stamp)) is None else v
            return known

        values = np.fromiter((version(stamp) for stamp in stamps), dtype=np.int64, count=len(stamps))
    return np.where(values < 0, default, values).astype(np.int64)


def route_dtype(num_experts: int, *, signed: bool = False) -> np.dtype:
    """The compact dtype of expert ids 0..num_experts-1, the one rule for routes on the wire, captured and replayed:
    uint8 up to 256 experts (unless `signed`: replay inputs fill "no route" with -1), int16 up to 32768 (ids <= 32767;
    -1 fits too), else int32."""
    return np.dtype(np.uint8 if num_experts <= 256 and not signed else np.int16 if num_experts <= 32768 else np.int32)


def compact_routes(routes: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """Expert ids [tokens, MoE layers, top_k] in their compact dtype (route_dtype of `num_experts`; None: of the
    largest id present). Ids outside [0, num_experts) are an error, not a silent wrap."""
    routes = np.asarray(routes)
    if routes.size and (int(routes.min()) < 0 or (num_experts is not None and int(routes.max()) >= num_experts)):
        raise ValueError(f"routed_experts holds expert ids in [{int(routes.min())}, {int(routes.max())}]; valid: "
                         f"[0, {num_experts if num_experts is not None else 'num_experts'})")
    dtype = route_dtype(num_experts if num_experts is not None else int(routes.max(initial=0)) + 1)
    return routes if routes.dtype == dtype else routes.astype(dtype)


def encode_routed_experts(experts: np.ndarray) -> str:
    """[rows, layers, top_k] integers -> SGLang's base64 little-endian int32 string."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, *, rows: int, num_layers: int, topk: int) -> np.ndarray:
    """SGLang's base64 int32 string -> [rows, layers, top_k] int32, checking the element count."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    if flat.size != rows * num_layers * topk:
        raise ValueError(f"routed_experts has {flat.size} int32 values; expected rows={rows} x layers={num_layers} "
                         f"x top_k={topk}")
    return flat.reshape(rows, num_layers, topk).copy()


# Request timeouts (issue #45): a call of 16 samples x 32k tokens generates 524k tokens, which no fixed timeout fits
# without also waiting that long for a hung engine on a small call. A call's timeout is rollout.request_timeout_s (the
# base: a small call slower than it is a hung engine) plus its token budget at this floor of tokens per second per
# call (an H100 SGLang engine decodes thousands per second over its calls in flight: 16 calls in flight at 50 each
# is a slow engine, and a hung one is still detected, later for a large call).
MIN_CALL_TOKENS_PER_S = 50.0


def call_timeout_s(requests: "list[GenerateRequest]", base_s: float) -> float:
    """The timeout of one /generate call of `requests`: base_s plus its token budget at MIN_CALL_TOKENS_PER_S."""
    return base_s + sum(r.sampling.max_new_tokens for r in requests) / MIN_CALL_TOKENS_PER_S
