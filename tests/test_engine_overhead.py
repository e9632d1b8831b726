"""Issue 32, the engine's fixed costs per step, each checked against what it replaced by an independent path:

- the batched sampler draws, row for row, the tokens `torch.multinomial` draws from the same distribution with the
  same generator (torch's own sampler is the reference; seeded rows must not change when the batch path changes);
- the engine's weights checksum, computed from its cached HF views of the parameters, equals the checksum of the
  full HF export (`hf_weights`: megatron's sharded state dict, gathered and mapped), and follows a changed weight.
"""

from __future__ import annotations

import pytest
import torch

from mpo.engine.generator import _Active, _distributions, _sample_rows
from mpo.rollout.protocol import SamplingParams


@pytest.mark.parametrize("params", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "top_k": 50, "top_p": 0.95},
])
def test_batched_sampler_draws_the_tokens_torch_multinomial_draws(params):
    torch.manual_seed(0)
    logits = torch.randn(64, 256) * 3
    sampling = SamplingParams(max_new_tokens=4, **params)

    def rows() -> list[_Active]:
        return [_Active(f"r{i}", [1], sampling, False, torch.Generator().manual_seed(1000 + i)) for i in range(64)]

    batched, reference = rows(), rows()
    probs = _distributions(logits, sampling)
    for _ in range(3):  # the generators advance the same way on both paths
        got = _sample_rows(logits, batched)
        want = [int(torch.multinomial(probs[k], 1, generator=row.generator)) for k, row in enumerate(reference)]
        assert got == want
    assert len(set(want)) > 10  # the draws are not all one token


def test_batched_sampler_mixes_sampling_groups_and_greedy_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 256)
    hot, cold, greedy = (SamplingParams(max_new_tokens=4, temperature=t) for t in (1.5, 0.5, 0.0))
    kinds = [hot, cold, greedy, hot, greedy, cold]
    rows = [_Active(f"r{i}", [1], s, False, torch.Generator().manual_seed(i)) for i, s in enumerate(kinds)]
    got = _sample_rows(logits, rows)
    for i, s in enumerate(kinds):
        if s.greedy:
            assert got[i] == int(logits[i].argmax())
        else:
            probs = _distributions(logits[i : i + 1], s)[0]
            assert got[i] == int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(i)))


def _checksums(out_file: str) -> None:
    from mpo.engine.model import EngineModel
    from mpo.parallel.ports import free_port
    from mpo.weight_sync.verify import weights_checksum

    engine = EngineModel.create(preset="tiny", mcore_dir=None, seed=3, dtype="fp32", fp32_lm_head=True,
                                dist_port=free_port())
    sums = [(engine.checksum(), weights_checksum(engine.hf_weights()))]
    named = dict(engine.hf_weights())
    name = next(n for n in named if "experts.5.down_proj" in n)
    changed = named[name].clone()
    changed[0, 0] += 1.0
    engine.load_hf({name: changed})
    sums.append((engine.checksum(), weights_checksum(engine.hf_weights())))
    torch.save(sums, out_file)


def test_engine_checksum_from_cached_views_equals_the_full_hf_exports(tmp_path):
    from helpers.spawn import spawn_ranks

    spawn_ranks(1, _checksums, str(tmp_path / "sums.pt"))  # the engine's own 1-rank world, as in its process
    (before, before_export), (after, after_export) = torch.load(tmp_path / "sums.pt")
    assert before == before_export and after == after_export
    assert after != before
