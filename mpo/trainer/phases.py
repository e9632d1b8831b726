"""Wall time per phase of an RL step (`logging.phase_times`), for `python -m mpo.bench step_profile`.

A `PhaseClock` adds the seconds spent inside `with clock("name"):` blocks to the step's total for that name;
`take()` returns them as `time/<name>_s` metrics and starts the next step's. Nested blocks each count their own span
(a parent's time includes its children's). Off by default: a disabled clock's blocks cost one attribute check, and
metrics rows stay free of wall-clock keys (resume tests compare rows). Phases that run after a step's metrics are
logged (the metrics write itself, checkpoint saves) land in the next step's row.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator


class PhaseClock:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()  # the async producer thread times rollout phases beside the training thread
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere (e.g. the engine's own time, reported in its responses)."""
        if self.enabled:
            with self._lock:
                self._seconds[name] += seconds

    def take(self) -> dict[str, float]:
        """This step's phase times as metrics, and a fresh start for the next step."""
        with self._lock:
            out = {f"time/{name}_s": seconds for name, seconds in self._seconds.items()}
            self._seconds.clear()
        return out
