"""PhaseClock (logging.phase_times): per-step sums of timed spans, nested spans counted each, reset by take()."""

from __future__ import annotations

import itertools
import os

from mpo.trainer import phases
from mpo.trainer.phases import PhaseClock


def test_phase_clock_sums_spans_per_step_and_resets(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(phases.time, "perf_counter", lambda: float(next(ticks)))
    clock = PhaseClock(enabled=True)
    with clock("collect"):  # 0 .. 3
        with clock("engine"):  # 1 .. 2
            pass
    with clock("collect"):  # 4 .. 5
        pass
    clock.add("http", 0.25)
    assert clock.take() == {"time/collect_s": 4.0, "time/engine_s": 1.0, "time/http_s": 0.25}
    assert clock.take() == {}


def test_disabled_clock_records_nothing():
    clock = PhaseClock()
    with clock("collect"):
        clock.add("engine", 1.0)
    assert clock.take() == {}


def test_quiet_drops_only_the_named_notices(caplog):
    """mpo.quiet: megatron's GPTModel deprecation notice is dropped at its logger; any other message of that logger,
    and the same text from another logger, still gets through."""
    import logging

    import mpo  # noqa: F401 - importing mpo installs the filters

    caplog.set_level(logging.WARNING)
    gpt_logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    gpt_logger.warning("GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")
    gpt_logger.warning("a real problem")
    logging.getLogger("elsewhere").warning("GPTModel IS DEPRECATED (quoted by someone else)")
    assert [r.getMessage() for r in caplog.records] == ["a real problem",
                                                         "GPTModel IS DEPRECATED (quoted by someone else)"]


def test_without_a_gpu_megatron_imports_without_torch_compile():
    """mpo.parallel.device.skip_torch_compile_without_gpu, in a fresh process as a rank or engine runs it: megatron's
    torch.compile-wrapped fusions come back as the plain functions (no dynamo wrapper was built), and a value the user
    set is kept (TORCHDYNAMO_DISABLE=0: wrapped as before)."""
    import subprocess
    import sys

    probe = ("import torch; from mpo.parallel.device import skip_torch_compile_without_gpu as s; s(); "
             "from megatron.core.fusions.fused_bias_geglu import geglu; "
             "print(hasattr(geglu, '_torchdynamo_orig_callable'))")
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    wrapped = {}
    for setting in (None, "0"):
        run_env = env if setting is None else {**env, "TORCHDYNAMO_DISABLE": setting}
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], env=run_env, capture_output=True,
                             text=True, check=True)
        wrapped[setting] = out.stdout.strip().splitlines()[-1]
    assert wrapped == {None: "False", "0": "True"}
