#!/usr/bin/env bash
# Run inside the CPU image by docker/test.sh (network off): `mpo demo` as the README runs it, then a smoke subset of
# the suite (checkpoint conversion, one parallel layout against TP1, mpo's engine). Its last line:
# demo_exact_first=<f> demo_exact_last=<l> tests_passed=<t>   (exit status non-zero when a test fails or l < 0.8)
set -euo pipefail
cd /opt/mpo
out=$(mktemp -d)
python -m mpo.cli demo --out "$out/demo" logging.progress=false logging.tensorboard=false > "$out/demo.log" 2>&1 \
    || { tail -40 "$out/demo.log"; echo "in_container_check: mpo demo failed (log above)" >&2; exit 1; }
tail -12 "$out/demo.log"
# Exact answers as the README states them: reward_exact_frac, mean of the first 5 and of the last 5 RL steps.
read -r first last < <(python - "$out/demo/metrics.jsonl" <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "reward_exact_frac" in r]
mean = lambda rs: sum(r["reward_exact_frac"] for r in rs) / len(rs)
print(f"{mean(rows[:5]):.3f} {mean(rows[-5:]):.3f}")
PY
)
status=0
python -m pytest -q -p no:cacheprovider --junitxml="$out/junit.xml" --durations=5 \
    tests/test_convert_qwen3.py "tests/test_layouts.py::test_layout_matches_tp1[layout-ep2]" tests/test_mpo_engine.py \
    || status=1
passed=$(python - "$out/junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
print(sum(int(suite.get(k)) * (1 if k == "tests" else -1) for k in ("tests", "failures", "errors", "skipped")))
PY
)
python -c "import sys; sys.exit(0 if float('$last') >= 0.8 else 1)" \
    || { echo "in_container_check: exact answers did not rise: last 5 RL steps $last < 0.8" >&2; status=1; }
echo "demo_exact_first=$first demo_exact_last=$last tests_passed=$passed"
exit $status
