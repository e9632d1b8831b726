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


@pytest.mark.parametrize("layout, layers, message", [
    (dict(pipeline_parallel=2), 3, "pipeline_parallel=2 does not divide num_layers=3; set parallel.num_layers_in_"
                                   "first_stage / num_layers_in_last_stage for uneven stages (e.g. num_layers_in_"
                                   "first_stage=1)"),
    (dict(pipeline_parallel=8), 61, "e.g. num_layers_in_first_stage=5"),
    (dict(pipeline_parallel=4, num_layers_in_first_stage=2), 6, "the other 4 of num_layers=6 layers cannot be split "
                                                                "equally over the 3 middle stage"),
    (dict(pipeline_parallel=2, num_layers_in_first_stage=1, num_layers_in_last_stage=1), 3, "the other 1 of"),
    (dict(pipeline_parallel=2, virtual_pipeline_parallel=2), 6, "virtual_pipeline_parallel=2 does not divide the 3 "
                                                                "layers of pipeline stage 0"),
    (dict(pipeline_parallel=1, num_layers_in_last_stage=2), 4, "num_layers_in_last_stage=2 needs pipeline_parallel"),
    (dict(pipeline_parallel=2, virtual_pipeline_parallel=1), 4, "virtual_pipeline_parallel=1; valid values: null or"),
])
def test_uneven_pp_bad_layouts_fail_in_one_line(layout, layers, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        ParallelConfig(**layout).validate(2 * 8, num_layers=layers)
    assert "\n" not in str(info.value)


def test_uneven_pp_config_error_is_one_line_in_the_cli(capsys):
    from mpo.cli import main

    code = main(["check-config", "--config", "mpo/recipes/demo_cpu.yaml", "parallel.virtual_pipeline_parallel=1"])
    err = capsys.readouterr().err
    assert code == 2 and err == "mpo: config error: parallel.virtual_pipeline_parallel=1; valid values: null or an " \
                                "integer >= 2\n"


def test_uneven_pp_stage_layers_of_the_real_models():
    """DeepSeek-V3 (61 layers) at PP8 and Qwen3-235B-A22B (94 layers) at PP8 x VPP2 place every layer once."""
    dsv3 = ParallelConfig(pipeline_parallel=8, num_layers_in_first_stage=5).stage_layers(61)
    assert [len(s[0]) for s in dsv3] == [5] + [8] * 7
    qwen = ParallelConfig(pipeline_parallel=8, num_layers_in_first_stage=10, num_layers_in_last_stage=12,
                          virtual_pipeline_parallel=2).stage_layers(94)
    assert [[len(c) for c in s] for s in qwen] == [[5, 5]] + [[6, 6]] * 6 + [[6, 6]]
    assert qwen[1][0] == tuple(range(5, 11)) and qwen[0][1] == tuple(range(47, 52))
    assert sorted(i for s in qwen for c in s for i in c) == list(range(94))
