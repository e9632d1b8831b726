"""Summarise an offline GPU tier run: OUT/gpu_results.json from OUT/steps.jsonl (exit code and seconds per step),
OUT/env.log (the machine), OUT/numbers.jsonl (what the tier's tests recorded with record.record) and the
benchmarks' last lines (`key=value` pairs). Prints the summary; exits 1 if it could not be written."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pairs(line: str) -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    for word in line.split():
        if "=" in word:
            key, value = word.split("=", 1)
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def summarise(out: Path) -> dict:
    summary: dict = {"steps": {}, "numbers": _jsonl(out / "numbers.jsonl")}
    env_log = out / "env.log"
    if env_log.is_file():
        try:
            summary["env"] = json.loads(env_log.read_text()[env_log.read_text().index("{"):])
        except ValueError:
            summary["env"] = env_log.read_text()[-2000:]
    for step in _jsonl(out / "steps.jsonl"):
        log = out / f"{step['step']}.log"
        lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
        step["timed_out"] = step["rc"] in (124, 137)
        step["tail"] = lines[-15:]
        if step["step"] in ("gpu_step", "cuda_ipc") and lines:
            step["last_line"] = lines[-1]
            step["values"] = _pairs(lines[-1].replace("MFU ", "mfu="))
        summary["steps"][step.pop("step")] = step
    return summary


if __name__ == "__main__":
    out = Path(sys.argv[1])
    summary = summarise(out)
    (out / "gpu_results.json").write_text(json.dumps(summary, indent=1))
    for name, step in summary["steps"].items():
        print(f"[gpu results] {name}: exit {step['rc']} in {step['seconds']:.0f} s"
              f"{' (timed out)' if step['timed_out'] else ''} {step.get('last_line', '')}")
    for number in summary["numbers"]:
        print(f"[gpu results] {json.dumps(number)}")
    print(f"[gpu results] written to {out / 'gpu_results.json'}")
