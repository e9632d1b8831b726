"""Every shipped recipe in mpo/recipes/ loads and validates, and the GPU ones place on their intended cluster.

Nothing is faked: GPU recipes point model.hf_dir at an architecture-only config.json (mpo/recipes/hf_configs/), which
is all validation and planning read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.plan import Allocation, LaunchOptions, make_plan
from mpo.config import load_config

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
