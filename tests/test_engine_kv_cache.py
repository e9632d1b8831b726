"""mpo's engine decodes a batch with a KV cache (one prefill, then one-token forwards at a shared position; longer
prompts teacher-forced). Rows of different prompt lengths, token budgets and stop tokens decode together and leave
the batch at different steps; every row's sampled log-probs, prompt log-probs (logprob_start_len=0) and routes must
equal the trainer's own forward (megatron-core's model built with the engine's seed, as a trainer rank builds it,
through mpo.models.forward.run_microbatches, no cache) over that row alone: two implementations (the engine is
transformers'), so the log-probs agree to float rounding and the routes exactly."""

from __future__ import annotations

import pytest
import torch

from helpers.spawn import spawn_ranks

PROMPTS = [[5], [3, 9, 27, 81, 4], [7, 7, 7, 2, 200, 13, 1, 66, 90], [11, 12], [250, 1, 2, 3, 4, 5, 6]]
BUDGETS = [6, 3, 9, 1, 5]


def _trainer_model(name: str, seed: int):
    """megatron-core's model of preset `name` built with `seed` as a trainer rank builds it (the engine's initial
    weights), with its routing hooks."""
    from mpo.models.builder import PrecisionConfig, build_model
    from mpo.models.config import preset
    from mpo.parallel import ParallelConfig
    from mpo.parallel.device import detect_device
    from mpo.routing import attach_routing_hooks

    model = build_model(preset(name), ParallelConfig(), detect_device(),
                        PrecisionConfig(dtype="fp32", fp32_lm_head=True), seed=seed)
    return model, attach_routing_hooks(model)


def _trainer_score(trainer, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [n], routes [n-1, L, K]) of one sequence by the trainer's forward (no cache), this row alone."""
    from mpo.models.forward import MicroBatch, run_microbatches

    model, hooks = trainer
    with torch.no_grad(), hooks.session() as capture:
        out = run_microbatches(model, [MicroBatch(torch.tensor([sequence]))], vocab_size=256, forward_only=True)[0]
    return out["logprobs"][0], capture.records[0].indices[0, :-1].to(torch.int32)


def _decode_and_score(out_file: str, name: str) -> None:
    import numpy as np

    from mpo.engine.generator import MpoGenerator
    from mpo.engine.model import EngineModel
    from mpo.parallel.ports import free_port
    from mpo.rollout.protocol import SamplingParams

    engine = EngineModel.create(preset=name, mcore_dir=None, seed=5, dtype="fp32", fp32_lm_head=True,
                                dist_port=free_port())
    generator = MpoGenerator(engine, vocab_size=engine.vocab_size, max_batch=8)
    # Row 4 stops on any token of the upper half of the vocabulary: rows finish by a stop token as well as by length.
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, sampling_seed=40 + i,
                             stop_token_ids=tuple(range(128, 256)) if i == 4 else ())
              for i, n in enumerate(BUDGETS)]
    answers = generator.submit_many(PROMPTS, params, routed_experts=True, logprob_start_len=0, timeout_s=120)
    generator.stop()
    trainer = _trainer_model(name, seed=5)
    rows = []
    for prompt, answer in zip(PROMPTS, answers):
        meta = answer["meta_info"]
        sequence = prompt + answer["output_ids"]
        reference, routes = _trainer_score(trainer, sequence)
        rows.append({
            "sequence": sequence, "finish": meta["finish_reason"]["type"],
            "output": torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64),
            "prompt": torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]], dtype=torch.float64),
            "first_prompt_logprob": meta["input_token_logprobs"][0][0],
            "reference": reference.to(torch.float64),
            # the generator's compact [tokens, MoE layers, top_k] array (the server encodes it for the wire)
            "routes": torch.from_numpy(np.asarray(meta["routed_experts"]).astype(np.int32)),
            "reference_routes": routes})
    torch.save(rows, out_file)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", ["tiny", "tiny-dsv3"])  # Qwen3-MoE; DeepSeek-V3 (MLA, a dense first layer)
def test_engine_kv_cache_batch_of_mixed_lengths_equals_the_trainers_forward(tmp_path, name):
    spawn_ranks(1, _decode_and_score, str(tmp_path / "out.pt"), name)
    rows = torch.load(tmp_path / "out.pt", weights_only=False)
    assert [row["finish"] for row in rows] == ["length"] * 4 + ["stop"]
    for prompt, budget, row in zip(PROMPTS, BUDGETS, rows):
        n = len(prompt)
        assert 1 <= len(row["sequence"]) - n <= budget
        assert row["first_prompt_logprob"] is None  # position 0 has no log-prob (SGLang's shape)
        assert (row["output"] - row["reference"][n:]).abs().max() <= 1e-5, row
        if n > 1:
            assert (row["prompt"] - row["reference"][1:n]).abs().max() <= 1e-5, row
        assert torch.equal(row["routes"].sort(-1).values, row["reference_routes"].sort(-1).values.to(torch.int32))
