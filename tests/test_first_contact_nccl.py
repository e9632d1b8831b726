"""First contact (issue #45, item 5): one NCCL in the weight-update group. `mpo train` and `launch` compare the
trainer's NCCL (its torch's torch.cuda.nccl.version()) with the engine Python's before any group is formed, refuse in
one line when they differ, and skip with a debug line where either side has none.

The only fake is the engine Python: a stand-in script that answers every probe as an interpreter whose torch has
another NCCL (or none) would, since this box has one torch build. The trainer's side is the real torch of the venv
(a CUDA wheel here: its NCCL version is readable without a GPU); where that torch has no NCCL the refusal cannot be
shown and those tests skip, saying so.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import one_line

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "mpo" / "recipes" / "demo_cpu.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
GSPO = REPO / "mpo" / "recipes" / "qwen3_30b_a3b_gspo.yaml"
OTHER = "2.21.5"  # an NCCL another torch build brings


def _stand_in(tmp_path: Path, answer: str) -> str:
    """An 'engine Python' that prints `answer` to any command (exit 0: it also passes the 'imports sglang' probe)."""
    path = tmp_path / "engine-python"
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture(scope="module")
def trainer_nccl() -> str:
    import torch

    if not torch.version.cuda:
        pytest.skip("this torch has no CUDA build, so no NCCL: the trainer side of the comparison is missing")
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001 - a torch without NCCL says so in its own words
        pytest.skip(f"this torch has no NCCL ({exc}): the trainer side of the comparison is missing")


def test_nccl_mpo_train_refuses_engines_with_another_nccl(trainer_nccl, tmp_path):
    engine = _stand_in(tmp_path, OTHER)
    out = subprocess.run([str(Path(sys.executable).with_name("mpo")), "train", "--config", str(RECIPE),
                          "rollout.engine=sglang", "sync.transport=distributed", f"logging.out_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env={**ENV, "MPO_ENGINE_PYTHON": engine}, timeout=300,
                         cwd=REPO)
    line = one_line(out.stderr)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"NCCL {trainer_nccl}" in line and f"NCCL {OTHER}" in line and "docs/one_nccl.md" in line, line


def test_nccl_launch_refuses_engines_with_another_nccl(trainer_nccl, tmp_path):
    engine = _stand_in(tmp_path, OTHER)
    # the production recipe (SGLang engines, distributed sync) on 4 nodes of 8 GPUs, as node 0's agent starts it
    out = subprocess.run([sys.executable, "-m", "launch", "--config", str(GSPO), "--hosts", "g1,g2,g3,g4",
                          "--gpus-per-node", "8", "--node-rank", "0", "--engine-python", engine,
                          "model.random_init=true", f"logging.out_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("launch: error:") and f"NCCL {OTHER}" in lines[0], out.stderr


def test_nccl_same_version_passes_and_none_skips_at_debug(trainer_nccl, tmp_path, caplog):
    from mpo.prestart import check_one_nccl

    check_one_nccl(None, _stand_in(tmp_path, trainer_nccl))  # the same build: nothing to say
    with caplog.at_level(logging.DEBUG, logger="mpo.prestart"):
        check_one_nccl(None, _stand_in(tmp_path, "none: torch without CUDA"))
    skipped = [r.getMessage() for r in caplog.records if "NCCL versions not compared" in r.getMessage()]
    assert len(skipped) == 1 and "torch without CUDA" in skipped[0] and r"\n" not in skipped[0], caplog.text
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
