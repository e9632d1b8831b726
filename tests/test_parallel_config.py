"""Parallel layouts are validated up front, with one line naming the field and the numbers."""

from __future__ import annotations

import pytest

from mpo.parallel import LayoutError, ParallelConfig


@pytest.mark.parametrize("layout, world, dims, message", [
    (dict(expert_parallel=3), 3, dict(num_experts=8), "expert_parallel=3 does not divide num_experts=8"),
    (dict(tensor_parallel=2), 3, {}, "world size 3 is not divisible by tensor_parallel"),
    (dict(pipeline_parallel=3), 3, dict(num_layers=4), "pipeline_parallel=3 does not divide num_layers=4"),
    (dict(tensor_parallel=3), 3, dict(num_attention_heads=4), "tensor_parallel=3 does not divide num_attention_heads"),
    (dict(expert_parallel=2, expert_tensor_parallel=2), 2, dict(num_experts=8), "expert_tensor_parallel*expert_parallel"),
    (dict(expert_parallel=2), 2, {}, "needs a model with experts"),
])
def test_bad_layouts_fail_naming_the_field(layout, world, dims, message):
    with pytest.raises(LayoutError, match=message.replace("*", r"\*")):
        ParallelConfig(**layout).validate(world, **dims)


@pytest.mark.parametrize("field", ["tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel"])
def test_sizes_must_be_positive(field):
    with pytest.raises(LayoutError, match=f"parallel.{field}=0"):
        ParallelConfig(**{field: 0})


def test_valid_layout_derives_data_parallel():
    layout = ParallelConfig(tensor_parallel=2, expert_parallel=2)
    layout.validate(8, num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=8)
    assert layout.data_parallel(8) == 4 and layout.use_sequence_parallel and layout.etp == 2
