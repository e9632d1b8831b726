"""Every shipped recipe in mpo/recipes/ loads and validates, and the GPU ones place on their intended cluster.

Nothing is faked: GPU recipes point model.hf_dir at an architecture-only config.json (mpo/recipes/hf_configs/), which
is all validation and planning read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.plan import Allocation, LaunchOptions, make_plan
from mpo.config_checks import load_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "mpo" / "recipes").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"demo_cpu.yaml", "qwen3_30b_a3b_gspo.yaml", "qwen3_30b_a3b_sapo.yaml", "qwen3_30b_a3b_rspo.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_validates(recipe):
    config = load_config(recipe.relative_to(REPO))
    assert config.world_size >= 1


@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.name.startswith("qwen3_30b_a3b")], ids=lambda p: p.name)
def test_gpu_recipe_plans_on_four_h100_nodes(recipe):
    path = str(recipe.relative_to(REPO))
    config = load_config(path)
    assert config.algorithm.replay == "r3" and config.parallel.expert_parallel == 8
    plan = make_plan(config, Allocation(tuple(f"g{i}" for i in range(4)), 8, "1"), LaunchOptions(config_path=path))
    assert [n.role for n in plan.nodes] == ["trainer", "trainer", "rollout", "rollout"]
    assert len(plan.engine_urls) == 4


GPU_RECIPES = [p for p in RECIPES if p.name.startswith(("qwen3_30b_a3b", "deepseek_v3"))]


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipe_fits_an_80gb_h100(recipe, capsys):
    """`mpo plan` accepts every shipped GPU recipe on 80 GB GPUs: every trainer stage (policy, and the critic of
    PPO/VAPO, with the distributed optimizer) and every SGLang engine the launcher would start."""
    from mpo.cli import main
    from mpo.config_checks import load_config
    from mpo.memory_plan import plan_memory

    code = main(["plan", "--config", str(recipe.relative_to(REPO)), "--gpu-mem-gb", "80"])  # 80e9 bytes: 74.5 GiB
    out = capsys.readouterr().out
    assert code == 0, out
    roles = plan_memory(load_config(recipe.relative_to(REPO)))
    assert all(role.fits for role in roles) and roles[0].items["policy optimizer"] > 0
    if load_config(recipe.relative_to(REPO)).algorithm.advantage in ("gae", "vapo"):
        assert "critic optimizer" in roles[0].items  # the critic's own Adam is counted


def test_plan_refuses_a_recipe_that_does_not_fit(capsys):
    """PPO's policy + critic at the GSPO layout (TP1 PP1) need more than 80 GB: exit 2, one line on stderr."""
    from mpo.cli import main

    code = main(["plan", "--config", "mpo/recipes/qwen3_30b_a3b_ppo.yaml", "parallel.tensor_parallel=1",
                 "parallel.pipeline_parallel=1", "parallel.expert_tensor_parallel=null"])
    captured = capsys.readouterr()
    assert code == 2 and "DOES NOT FIT" in captured.out
    assert captured.err.strip().splitlines() == ["mpo: memory plan: trainer (pipeline stage 0 of 1) does not fit in "
                                                 "79.6 GiB"]
    code = main(["check-config", "--config", "mpo/recipes/qwen3_30b_a3b_ppo.yaml", "parallel.tensor_parallel=1",
                 "parallel.pipeline_parallel=1", "parallel.expert_tensor_parallel=null"])
    assert code == 2 and "DOES NOT FIT" in capsys.readouterr().err


def test_uneven_pp_deepseek_v3_recipe_places_on_32_nodes():
    """DeepSeek-V3's 61 layers over PP16 (3 + 14 x 4 + 2) place on the 32 nodes the recipe names; engines are
    external."""
    path = "mpo/recipes/deepseek_v3_gspo.yaml"
    config = load_config(path)
    stages = config.parallel.stage_layers(61)
    assert [len(s[0]) for s in stages] == [3] + [4] * 14 + [2]
    plan = make_plan(config, Allocation(tuple(f"g{i}" for i in range(32)), 8, "1"), LaunchOptions(config_path=path))
    assert [n.role for n in plan.nodes] == ["trainer"] * 32 and plan.placement == "external"
