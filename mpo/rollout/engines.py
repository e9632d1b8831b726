"""Rank 0's engines (EngineSet): connects to configured URLs (dropped while they stop answering: check_external), or
starts local mpo engines and restarts them if they die, stale (no rollout work) until a weight sync reaches them. The
set keeps no sync state: the publisher owns the weight-update session (the client side imports nothing of
mpo.weight_sync, which imports it).

Engines the set starts always have a key: rollout.api_key, else a random one made here (EngineSet.api_key). A
keyless engine on loopback serves its weight and memory routes to every user of the host (the port shows in `ps`);
with the key, only this run's own clients (the set's, which the producer child and the evaluator share, and the
other senders', told by the publisher) are served. The key reaches the engines in their environment, never argv,
and is logged only masked (masked_key)."""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpo.config import RolloutSection
    from mpo.models.config import MoEModelConfig
    from mpo.rollout.engine_command import EngineSettings
    from mpo.rollout.local_engine import LocalEngineProcess

log = logging.getLogger(__name__)
# The CPU priority (nice) of local engines in the off-policy modes (see mpo.trainer.loop.engine_set).
LOCAL_ENGINE_NICE = 10
# How long an engine given by URL has to answer /model_info before a weight update, or be dropped from the run
# (EngineSet.check_external): the HTTP front end answers it at once even while the engine generates.
ANSWER_TIMEOUT_S = 10.0


def silence(client, timeout_s: float) -> str | None:
    """Why `client`'s engine does not answer a light GET (/model_info) within `timeout_s` (one line), or None if it
    answers: any HTTP answer counts (an error status says the server is up; its calls say what is wrong)."""
    from mpo.rollout.client import EngineError

    try:
        client.call("/model_info", method="GET", timeout_s=timeout_s)
    except EngineError as exc:
        return None if exc.status is not None else str(exc).removeprefix(f"engine {client.url}: ")
    return None


def masked_key(key: str | None) -> str:
    """How a key may appear in a log: its first 4 characters, enough to tell two keys apart, never to use one."""
    return "none" if not key else f"{key[:4]}\u2026"


class EngineSet:
    """Rank 0's engines: those at `rollout.urls`, else `rollout.num_engines` local mpo engines started with
    `settings` (EngineSettings.from_config) at CPU priority `nice`, logging under `out_dir`; serving the model `model`
    (its MoEModelConfig: routed-expert shapes). mpo.trainer.loop.engine_set builds one from a run's config."""

    def __init__(self, rollout: RolloutSection, out_dir: Path, model: MoEModelConfig, *,
                 settings: EngineSettings | None = None, nice: int = 0, wait: bool = True) -> None:
        """wait=False: local engines are launched, not waited for (wait_ready does): loop.run starts them before the
        ranks build their models, so the two start-ups overlap."""
        from mpo.rollout.client import EngineClient

        r = rollout
        self.processes: list[LocalEngineProcess] = []
        self.engine = r.engine
        self.tp_size = r.tensor_parallel if r.engine == "sglang" else 1  # weight-update ranks per engine
        self.stale: set[str] = set()  # URLs of local engines restarted since a weight sync last reached them
        # Restarts (the rollout pool's, on its thread) and weight updates (the trainer's) one at a time: in async mode
        # the producer restarts a killed engine while the trainer syncs, whose pause then hit a dead engine.
        self._engine_lock = threading.RLock()
        # Engines given by URL were started by the user: their key is the user's setting (rollout.api_key)
        self.api_key: str | None = r.api_key
        # Engines given by URL that stopped answering, left out of the run: url -> why (check_external)
        self.dropped: dict[str, str] = {}
        # Changes of who is in the run (a drop, a re-admission): the publisher's weight-update session was formed
        # for the engines of one membership, and is formed anew when it changes (its distributed group held them)
        self.membership = 0
        if r.urls:
            clients = [EngineClient(url, api_key=r.api_key, timeout_s=r.request_timeout_s,
                                    num_layers=model.num_layers, topk=model.router_topk,
                                    num_experts=model.num_experts, prompt_routes_once=r.engine == "sglang")
                       for url in r.urls]
            # not restartable by us; takes work unless dropped (or re-admitted and not synced yet)
            self.handles = [(c, None, functools.partial(self._takes_work, c.url)) for c in clients]
            return
        if r.engine != "mpo":
            raise ValueError("rollout.urls is empty: only rollout.engine='mpo' can be started locally; SGLang servers "
                             "are started by the launcher (launch/) and passed as rollout.urls")
        if not self.api_key:
            self.api_key = secrets.token_urlsafe(32)
            log.info("local engines: rollout.api_key is unset; they get a random key (%s) that only this run's "
                     "clients send", masked_key(self.api_key))
        if settings is None:
            raise ValueError("EngineSet: local engines need their EngineSettings (settings=...)")
        try:  # all launched, then all awaited; one that fails to launch stops those already started
            for process in self.local_processes(r.num_engines, settings, out_dir, model, api_key=self.api_key,
                                                nice=nice):
                self.processes.append(process.launch())
        except BaseException:
            self.stop()
            raise
        if wait:
            self.wait_ready()
        # p.url read when asked: an engine whose port was taken at start-up moves to another (LocalEngineProcess)
        self.handles = [(p.client, functools.partial(self._restart, p), lambda p=p: p.url not in self.stale)
                        for p in self.processes]

    def wait_ready(self) -> None:
        """Every local engine serves (a no-op for configured URLs); if one fails to start, all are stopped."""
        try:
            for process in self.processes:
                process.wait_ready()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def local_processes(count: int, settings: EngineSettings, out_dir: Path, model: MoEModelConfig, *,
                        api_key: str | None = None, nice: int = 0) -> list:
        """`count` local mpo engines started with `settings`, not started yet. Their command comes from the same
        builder as the launcher's (mpo.rollout.engine_command), so both start the same engine. `api_key` (EngineSet's
        generated key) replaces the settings' key when given."""
        from mpo.rollout.local_engine import LocalEngineProcess

        return [LocalEngineProcess.mpo_engine(log_path=out_dir / "logs" / f"engine{i}.log", settings=settings,
                                              api_key=api_key, num_layers=model.num_layers, topk=model.router_topk,
                                              nice=nice)
                for i in range(count)]

    def _restart(self, process) -> None:
        """Restart a local engine, stale until the next weight sync. Waits for a weight update in flight; an engine
        that another thread brought back meanwhile is left alone."""
        with self._engine_lock:
            if process.process is not None and process.process.poll() is None and process.client.healthy(2.0):
                return  # restarted (or found healthy) while this caller waited for the lock
            process.restart()
            self.stale.add(process.url)

    @contextlib.contextmanager
    def updating(self):
        """Rank 0, around a weight update: no engine restart runs meanwhile (one in flight finishes first); a local
        engine found down is restarted before the update, so that its pause / push reach a live engine; one that dies
        during the update is left out of it (WeightSync.expendable) and restarted after it, stale. Engines given by
        URL cannot be restarted by us: check_external drops those that stopped answering before the update (and
        re-admits dropped ones that answer again); one left out of the update (not `distributed`) is dropped after."""
        with self._engine_lock:
            self._restart_exited("before")
            self.check_external()
            yield
            self._restart_exited("after")

    def drop_lost(self, lost: set[str]) -> None:
        """After a weight update (rank 0, inside `updating`): engines given by URL that the session left out (they
        failed in it) are dropped from the run; local ones are restarted by `updating` instead."""
        if lost and not self.processes:
            self._drop({url: "it failed during the weight update" for url in lost})

    def _takes_work(self, url: str) -> bool:
        """An engine given by URL takes rollout work unless dropped, or re-admitted and not synced yet (stale)."""
        return url not in self.dropped and url not in self.stale

    def check_external(self) -> None:
        """Before a weight update (rank 0, with the engine lock): every engine given by URL (rollout.urls) that does
        not answer a light call (/model_info: the HTTP front end, not the busy scheduler) is dropped from the run,
        and a dropped one that answers again is re-admitted, stale until this update reaches it; either changes the
        membership (the publisher's session is formed anew). Raises RolloutFailed (one line) when no engine is left."""
        if self.processes or not self.handles:
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.handles)) as pool:  # in parallel: a host that is gone costs one timeout
            silent = dict(zip((c.url for c, _, _ in self.handles),
                              pool.map(lambda h: silence(h[0], ANSWER_TIMEOUT_S), self.handles)))
        back = [url for url in self.dropped if silent[url] is None]
        for url in back:
            log.warning("engine %s answers again: re-admitted to the run (it gets this weight update)", url)
            del self.dropped[url]
            self.stale.add(url)
        gone = {url: why for url, why in silent.items() if why is not None and url not in self.dropped}
        if gone:
            self._drop(gone)
        elif back:
            self.membership += 1

    def _drop(self, gone: dict[str, str]) -> None:
        """Leave the engines given by URL in `gone` (url -> why) out of the run: one warning line each; the run fails
        in one line (RolloutFailed) once none is left."""
        from mpo.rollout.pool import RolloutFailed

        total = len(self.handles)
        for url, why in gone.items():
            self.dropped[url] = why
            log.warning("engine %s stopped answering (%s): dropped from the run, %d of %d engines left (it is "
                        "re-admitted if it answers again before a weight sync)", url, why, total - len(self.dropped),
                        total)
        self.membership += 1
        if len(self.dropped) == total:
            raise RolloutFailed("rollout: no engine left, every engine of rollout.urls stopped answering: "
                                + "; ".join(f"{url} ({why})" for url, why in self.dropped.items()))

    def _restart_exited(self, when: str) -> None:
        for process in self.processes:  # exited (a busy engine may answer health checks slowly: not asked)
            if process.process is None or process.process.poll() is not None:
                log.warning("engine %s is down %s the weight update; restarting it", process.url, when)
                self._restart(process)

    def exited(self, client) -> bool:
        """Whether `client` is a local engine whose process exited (waited for briefly: a killed engine's connections
        close just before its process is gone), or an engine given by URL that no longer answers."""
        if not self.processes:
            return silence(client, ANSWER_TIMEOUT_S) is not None
        for process in self.processes:
            if process.client is client and process.process is not None:
                try:
                    process.process.wait(timeout=2.0)
                    return True
                except subprocess.TimeoutExpired:
                    return False
        return False

    @property
    def clients(self):
        """The engines in the run: every local one; those given by URL less the dropped ones."""
        return [handle[0] for handle in self.handles if handle[0].url not in self.dropped]

    def engine_tp_sizes(self) -> list[int]:
        """Weight-update ranks of each engine: its own `tp_size` from /server_info (SGLang's --tp; mpo's engine
        reports 1), else the configured rollout.tensor_parallel (an engine that cannot be asked now). A configured
        size that the engine contradicts is logged and the engine's is used: a wrong group size hangs the sync."""
        sizes = []
        for client in self.clients:
            try:
                reported = client.call("/server_info", method="GET", timeout_s=10).get("tp_size")
            except Exception:  # noqa: BLE001 - unreachable now (e.g. not started yet): the configured size
                reported = None
            if not (isinstance(reported, int) and reported >= 1):
                reported = self.tp_size
            elif reported != self.tp_size:
                log.warning("engine %s reports tp_size=%d; rollout.tensor_parallel says %d: using %d",
                            client.url, reported, self.tp_size, reported)
            sizes.append(reported)
        return sizes

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
