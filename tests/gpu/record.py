"""How the GPU tier's tests report a number: a `[gpu]` line on stderr (pytest -s shows it) and, when MPO_GPU_RESULTS
names a file (the offline tier sets it), one JSON line appended there for gpu_results.json."""

from __future__ import annotations

import json
import os
import sys


def record(name: str, message: str, **numbers) -> None:
    print(f"\n[gpu] {message}", file=sys.stderr)
    path = os.environ.get("MPO_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, **numbers}) + "\n")
