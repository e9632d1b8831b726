"""Tests against a REAL sglang 0.5.23 server (CPU, fp32, tiny random Qwen3-MoE), started once for this module.

The server runs from `.venv-sglang` (tests/sglang_harness/setup.sh); these tests run in the main venv and talk to it
over HTTP and gloo only. Reference numbers come from an HF transformers fp32 forward of the same tokens.
If sglang cannot be installed or imported, every test here skips with a reason starting "SGLANG TIER SKIPPED:" (in
CI, CI=true, they fail instead: helpers/tiers.py).
"""
from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers.sglang_client import (
    decode_routed_experts,
    http_json,
    flatten_bucket,
    join_weight_update_group,
    serialize_for_sglang,
)
from helpers.sglang_server import SGLangServer, serve_module
from mpo.parallel.ports import free_port
from helpers.tiny_hf import load_tiny_model, make_tiny_qwen3_moe

VOCAB = 256
NUM_LAYERS = 2
TOP_K = 2
PROMPT = [1, 10, 11, 12, 13, 14, 15]
LOGPROB_TOL = 1e-4
TIMEOUT = 120
API_KEY = "mpo-sglang-test-K3y"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0, vocab=VOCAB)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, model_dir: Path):
    # With a key: the server starts through the launcher's key-in-environment command (hardening test below).
    yield from serve_module(request, model_dir, api_key=API_KEY)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return load_tiny_model(model_dir)


def post(server: SGLangServer, path: str, payload: dict, timeout: float = TIMEOUT) -> tuple[int, dict]:
    return http_json(server.url + path, payload, server.headers, timeout)


def generate(server: SGLangServer, prompt: list[int], max_new_tokens: int = 12, **sampling) -> dict:
    sampling_params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
    status, body = post(server, "/generate", {
        "input_ids": prompt, "sampling_params": sampling_params,
        "return_logprob": True, "return_routed_experts": True,
    })
    assert status == 200, body
    return body


def hf_reference(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T, V], router top-k indices [T, layers, k]) of one fp32 HF forward over `tokens`."""
    picked: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: picked.__setitem__(i, out[2].detach()))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    experts = torch.stack([picked[i] for i in range(len(model.model.layers))], dim=1)
    return torch.log_softmax(logits, dim=-1), experts


def compare_with_hf(model, prompt: list[int], out: dict) -> tuple[float, float]:
    """Assert the server's output logprobs and routed experts match HF; return (max |logprob diff|, agreement)."""
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    out_ids = [t[1] for t in triples]
    assert out_ids == out["output_ids"]
    tokens = prompt + out_ids
    ref_lp, ref_experts = hf_reference(model, tokens)
    n = len(prompt)
    ref = torch.tensor([ref_lp[n - 1 + j, tok].item() for j, tok in enumerate(out_ids)], dtype=torch.float64)
    got = torch.tensor([t[0] for t in triples], dtype=torch.float64)
    max_diff = (got - ref).abs().max().item()
    assert max_diff < LOGPROB_TOL, f"logprob max |server - HF| = {max_diff:.3e} (tol {LOGPROB_TOL})"

    routed = decode_routed_experts(meta["routed_experts"], NUM_LAYERS, TOP_K)
    assert routed.shape == (len(tokens) - 1, NUM_LAYERS, TOP_K), routed.shape
    ref_sets = ref_experts[: len(tokens) - 1].tolist()
    agree = sum(
        set(routed[t, layer].tolist()) == set(ref_sets[t][layer])
        for t in range(routed.shape[0]) for layer in range(NUM_LAYERS)
    ) / (routed.shape[0] * NUM_LAYERS)
    assert agree == 1.0, f"routed experts agree with HF's router top-{TOP_K} on {agree:.1%} of (token, layer)"
    return max_diff, agree


def test_generate_logprobs_and_routed_experts_match_hf(server, hf_model):
    out = generate(server, PROMPT, max_new_tokens=12)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    greedy_diff, agree = compare_with_hf(hf_model, PROMPT, out)
    # Sampled (temperature 1, seeded): the logprobs are still those of the untempered model distribution.
    sampled = generate(server, PROMPT, max_new_tokens=12, temperature=1.0, sampling_seed=1234)
    sampled_diff, _ = compare_with_hf(hf_model, PROMPT, sampled)
    print(f"\n[sglang] logprob max |diff| vs HF: greedy {greedy_diff:.2e}, sampled {sampled_diff:.2e}; "
          f"routed experts agreement {agree:.0%}", file=sys.stderr)


def test_update_outside_session_is_http_400(server):
    r = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [], "load_format": "flattened_bucket"})
    status, body = r
    assert status == 400, body
    assert body["success"] is False
    assert "begin_weight_update" in body["message"], body


def _call_in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # re-raised by the caller
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def _joined(th: threading.Thread, box: dict):
    th.join(TIMEOUT)
    assert not th.is_alive(), "HTTP request did not return"
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_update_weights_from_distributed_gloo(server):
    group_name = "mpo_test_gloo"
    port = free_port()
    assert post(server, "/begin_weight_update", {})[0] == 200
    th, box = _call_in_thread(post, server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": group_name, "backend": "gloo",
    })
    group = join_weight_update_group("127.0.0.1", port, world_size=2, group_name=group_name)
    r = _joined(th, box)
    assert r[0] == 200, r

    zeros = torch.zeros(VOCAB, 64, dtype=torch.float32)
    th, box = _call_in_thread(post, server, "/update_weights_from_distributed", {
        "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [list(zeros.shape)],
        "group_name": group_name, "weight_version": "dist1",
    })
    torch.distributed.broadcast(zeros, src=0, group=group)
    r = _joined(th, box)
    assert r[0] == 200, r
    assert post(server, "/end_weight_update", {})[0] == 200

    out = generate(server, PROMPT, max_new_tokens=4)
    assert out["meta_info"]["weight_version"] == "dist1"
    lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    diff = max(abs(lp + math.log(VOCAB)) for lp in lps)
    print(f"\n[sglang] distributed update (gloo): lm_head=0 gives logprobs {lps[0]:.6f}, "
          f"max |lp + ln V| = {diff:.2e}", file=sys.stderr)
    assert diff < 1e-5, lps
    r = post(server, "/destroy_weights_update_group", {"group_name": group_name})
    assert r[0] == 200, r
    torch.distributed.destroy_process_group(group)


def test_update_weights_from_tensor_flattened_bucket(server, hf_model):
    """Restore the original lm_head (undoing the distributed test if it ran) and permute layer 0's router, through
    the flattened-bucket tensor path; the server must then match HF carrying the same weights."""
    gate = hf_model.model.layers[0].mlp.gate.weight
    _, experts_before = hf_reference(hf_model, PROMPT)
    with torch.no_grad():
        gate.copy_(gate.flip(0))  # expert e's router row becomes expert (E-1-e)'s
    named = [("lm_head.weight", hf_model.lm_head.weight), ("model.layers.0.mlp.gate.weight", gate)]
    payload = serialize_for_sglang(flatten_bucket(named))
    assert post(server, "/begin_weight_update", {})[0] == 200
    r = post(server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [payload], "load_format": "flattened_bucket", "weight_version": "bucket1",
    })
    assert r[0] == 200, r
    assert post(server, "/end_weight_update", {})[0] == 200
    out = generate(server, PROMPT, max_new_tokens=12)
    assert out["meta_info"]["weight_version"] == "bucket1"
    diff, agree = compare_with_hf(hf_model, PROMPT, out)
    routed = decode_routed_experts(out["meta_info"]["routed_experts"], NUM_LAYERS, TOP_K)
    changed = [set(routed[t, 0].tolist()) != set(experts_before[t, 0].tolist()) for t in range(len(PROMPT))]
    assert any(changed), "layer-0 routing of the prompt did not change after the router update"
    print(f"\n[sglang] flattened_bucket update: logprob max |diff| vs HF {diff:.2e}, routed experts agreement "
          f"{agree:.0%}", file=sys.stderr)


def test_hardening_sglang_key_is_required_and_never_on_argv(server: SGLangServer):
    """The launcher's SGLang command passes the key in MPO_API_KEY: no process of the server (its process group:
    the HTTP server and its schedulers) shows it on argv, and SGLang enforces it."""
    group = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == server.proc.pid:
                group.append((entry / "cmdline").read_bytes())
        except (OSError, ProcessLookupError):
            continue
    assert group, "no process found in the server's process group"
    assert not any(API_KEY.encode() in cmdline for cmdline in group)
    status, _ = http_json(server.url + "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
                          {}, TIMEOUT)
    assert status == 401
