"""A response that straddles an in-flight weight update (schedule.mode=async), at the engine level and without
timing luck: mpo's engine (its scheduler, MpoGenerator, over the real tiny model, EngineModel) is paused right after
its 3rd decode step, new weights are applied as a weight update applies them (under the model lock, with a new
version), and generation continues. The response must carry per-token versions (3 tokens of v0, the rest of v1) and
per-token behaviour log-probs: the first 3 tokens' under the old weights, the rest under the new ones, each checked
against the engine's own scorer run on the whole sequence at each set of weights."""

from __future__ import annotations

import threading
import time

import torch

from helpers.spawn import spawn_ranks

PAUSE_AFTER = 3
NEW_TOKENS = 8
PROMPT = (1, 5, 9, 13, 3)


def _partial_rollout(out_file: str) -> None:
    from mpo.parallel.ports import free_port
    from mpo.engine.generator import MpoGenerator
    from mpo.engine.model import EngineModel
    from mpo.rollout.protocol import SamplingParams

    engine = EngineModel.create(preset="tiny", mcore_dir=None, seed=3, dtype="fp32", fp32_lm_head=True,
                                dist_port=free_port())
    old = {name: tensor.clone() for name, tensor in engine.hf_weights()}
    g = torch.Generator().manual_seed(0)
    new = {name: t + 0.2 * t.std().nan_to_num(1.0) * torch.randn(t.shape, generator=g) for name, t in old.items()}
    calls = [0]
    holder: dict = {}

    class Paused:  # the engine's model, pausing the scheduler after its PAUSE_AFTER-th forward (prefill included)
        def __getattr__(self, name):
            return getattr(engine, name)

        def _counted(self, out):
            calls[0] += 1
            if calls[0] == PAUSE_AFTER:  # the scheduler appends this step's token, then waits: a deterministic pause
                holder["generator"].pause()
            return out

        def prefill(self, ids, **kw):
            return self._counted(engine.prefill(ids, **kw))

        def decode(self, cache, ids, **kw):
            return self._counted(engine.decode(cache, ids, **kw))

    generator = holder["generator"] = MpoGenerator(Paused(), vocab_size=engine.vocab_size, weight_version="v0")
    prompt = list(PROMPT)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(response=generator.submit(
        prompt, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, sampling_seed=11), routed_experts=True)))
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (generator._active and len(generator._active[0].output) == PAUSE_AFTER):
        time.sleep(0.01)
    time.sleep(0.2)  # the scheduler is parked in its paused wait (it would have taken a 4th step by now otherwise)
    assert len(generator._active[0].output) == PAUSE_AFTER
    with generator.model_lock:  # what a weight update does (mpo.engine.weight_routes.WeightRoutes.apply)
        engine.load_hf(new)
        generator.weight_version = "v1"
    generator.resume()
    thread.join(timeout=60)
    meta = result["response"]["meta_info"]
    sequence = prompt + result["response"]["output_ids"]
    scored, routes = {}, {}
    for name, weights in (("old", old), ("new", new)):
        engine.load_hf(weights)
        [(logprobs, routes[name])] = engine.score([sequence], True)
        scored[name] = logprobs[len(prompt):]
    generator.stop()
    import numpy as np

    torch.save({"versions": meta["output_token_weight_versions"],
                "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]], "scored": scored,
                # the generator's compact [tokens, MoE layers, top_k] array (the server encodes it for the wire)
                "routes": torch.from_numpy(np.asarray(meta["routed_experts"]).astype(np.int32)),
                "scored_routes": {k: torch.from_numpy(v) for k, v in routes.items()}}, out_file)
    torch.distributed.destroy_process_group()


def test_a_response_straddling_a_weight_update_keeps_per_token_versions_and_behaviour_logprobs(tmp_path):
    spawn_ranks(1, _partial_rollout, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["versions"] == ["v0"] * PAUSE_AFTER + ["v1"] * (NEW_TOKENS - PAUSE_AFTER)
    got = torch.tensor(out["logprobs"], dtype=torch.float64)
    old = torch.tensor(out["scored"]["old"], dtype=torch.float64)
    new = torch.tensor(out["scored"]["new"], dtype=torch.float64)
    assert (old - new).abs()[:PAUSE_AFTER].max() > 1e-2, "the update must change these tokens' log-probs"
    assert (got[:PAUSE_AFTER] - old[:PAUSE_AFTER]).abs().max() <= 1e-5, (got, old)  # sampled under v0
    assert (got[PAUSE_AFTER:] - new[PAUSE_AFTER:]).abs().max() <= 1e-5, (got, new)  # sampled under v1
    # Routes: every position's from the last weights (the engine re-runs the sequence under them after the update;
    # the cache made under v0 is not extended), as the trainer's forward routes it at those weights.
    routes, new_routes = out["routes"], out["scored_routes"]["new"]
    assert routes.shape == new_routes.shape == (len(PROMPT) + NEW_TOKENS - 1, 4, 2)
    assert torch.equal(routes.sort(-1).values, new_routes.sort(-1).values.to(routes.dtype))
    assert not torch.equal(new_routes, out["scored_routes"]["old"]), "the update must change some routes"
