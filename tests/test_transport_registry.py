"""Weight-sync transports are classes in one registry (mpo.weight_sync.transports.TRANSPORTS): the built-ins are
listed there, and a user's transport class from a file (`sync.transport=path/to/my_transport.py:MyTransport`) passes
the config check and carries the weight syncs of a real `mpo train` run into mpo's engine (trainer rank, engine
process, shared-memory buckets, the engine's checksum verified after every sync). Nothing is faked.

The plug-in is written out here as a user would: mpo's shm transport, counting every bucket it pushes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from mpo.config import ConfigError
from mpo.config_checks import load_config

RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"
MY_TRANSPORT = textwrap.dedent('''
    from pathlib import Path

    from mpo.weight_sync.transport_shm import ShmTransport

    PUSHES = Path(__file__).with_name("pushes.log")


    class CountingShm(ShmTransport):
        """mpo's shm transport, writing one line per bucket it pushes: the weight version and its tensors."""

        def push(self, bucket, version, *, wait):
            with PUSHES.open("a") as f:
                f.write(f"{version} {len(bucket)}\\n")
            return super().push(bucket, version, wait=wait)
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_transport.py").write_text(MY_TRANSPORT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_transport_registry_lists_the_builtins():
    from mpo.weight_sync.transports import TRANSPORTS, Transport, check_transport

    assert TRANSPORTS.names() == ["cuda_ipc", "distributed", "shm", "tensor"]
    for name, cls in TRANSPORTS.items():
        assert issubclass(cls, Transport) and cls.engines, name
    # what each can reach is the class's own word, and the one check reads it
    assert TRANSPORTS.get("shm").engines == ("mpo",) and TRANSPORTS.get("shm").in_place
    assert TRANSPORTS.get("distributed").stages_at_once(2, 4) is False
    with pytest.raises(ValueError, match=r"^sync.transport='cuda_ipc' is SGLang's colocated GPU path; "
                                         r"rollout.engine='mpo' takes 'distributed', 'shm' or 'tensor'$"):
        check_transport("cuda_ipc", "mpo")


def test_transport_plugin_from_a_file_passes_the_config_check(plugin):
    config = load_config(RECIPE, ["sync.transport=my_transport.py:CountingShm"])
    assert config.sync.transport == "my_transport.py:CountingShm"
    # the user's class says what it reaches (inherited from shm): SGLang engines are refused in one line
    with pytest.raises(ConfigError, match=r"^sync.transport='my_transport.py:CountingShm' is mpo's engine's "
                                          r"same-host path; rollout.engine='sglang' takes"):
        load_config(RECIPE, ["sync.transport=my_transport.py:CountingShm", "rollout.engine=sglang",
                             "rollout.urls=[http://127.0.0.1:9]"])
    with pytest.raises(ConfigError, match=r"^sync.transport='my_transport.py:PUSHES' is .* not a subclass of "
                                          r"mpo.weight_sync.transports.Transport$"):
        load_config(RECIPE, ["sync.transport=my_transport.py:PUSHES"])
    with pytest.raises(ConfigError, match=r"^transport 'nope.py:T': no Python file"):
        load_config(RECIPE, ["sync.transport=nope.py:T"])
    with pytest.raises(ConfigError, match=r"^sync.transport='bogus'; valid values: 'auto', 'cuda_ipc', 'distributed', "
                                          r"'shm', 'tensor', or a transport class as 'module:attr' / "
                                          r"'path/to/file.py:attr'$"):
        load_config(RECIPE, ["sync.transport=bogus"])


def test_transport_plugin_carries_the_syncs_of_a_real_run(plugin):
    out = plugin / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([str(Path(sys.executable).with_name("mpo")), "train", "--config", str(RECIPE),
                             "sync.transport=my_transport.py:CountingShm", "schedule.steps=2",
                             "schedule.sft_steps=0", "eval.every=0", f"logging.out_dir={out}",
                             "logging.progress=false", "logging.checkpoint_every=0", "logging.tensorboard=false"],
                            capture_output=True, text=True, env=env, cwd=plugin, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "sync_buckets" in line]
    assert rows, "no sync metrics logged"
    pushes = [line.split() for line in (plugin / "pushes.log").read_text().splitlines()]
    per_version = Counter(version for version, _ in pushes)
    # every logged sync went through the user's class, bucket for bucket (the engine's checksum matched the
    # trainer's after each, or the run would have failed)
    for row in rows:
        assert per_version[str(row["step"] + 1)] == row["sync_buckets"] > 0, (row["step"], per_version)
    assert all(int(tensors) > 0 for _, tensors in pushes)
