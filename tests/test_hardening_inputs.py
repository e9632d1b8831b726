"""Issue 12 items 14-17: untrusted checkpoint files run no code, every bad input gets one line, ranges are checked.

Every case runs the real command line (`python -m checkpoints_tools ...`, `python -m mpo.cli check-config ...`) and
checks its exit status, that stderr is exactly one line, and that there is no traceback. A few cases start a fresh
interpreter; the rest call the same `main(argv)` in this process to keep the module fast. The
malicious pickles are real: a `__reduce__` that calls `open(marker, "w")`; each fixture first proves the payload
creates its marker when unpickled normally, so "no marker" means the payload was refused, not that it was inert.
Nothing is faked.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.cli import one_line as _one_line
from helpers.cli import run_main as _main
from helpers.tiny_hf import tiny_qwen3_moe

RECIPE = Path(__file__).resolve().parents[1] / "mpo" / "recipes" / "demo_cpu.yaml"
COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron's ShardedObject key of the common state dict


class CreatesFile:
    """A pickle payload: unpickling it opens (creates) `marker` for writing."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run(module: str, *args: str) -> tuple[int, str]:
    """The command line in a fresh interpreter: `python -m MODULE ARGS`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                            env=env)
    return result.returncode, result.stderr


def _payload_works(payload: bytes, control: Path) -> None:
    """The payload is live: plain pickle runs it and creates its marker (a control path here, then removed)."""
    pickle.loads(payload)
    assert control.exists()
    control.unlink()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One tiny sharded HF Qwen3-MoE checkpoint and its torch_dist conversion, shared (read-only) by the module."""
    from checkpoints_tools.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("hardening")
    hf = tiny_qwen3_moe(root / "hf")
    hf_to_mcore(hf, root / "mc", show_progress=False)
    return root


def _evil_metadata(tiny: Path, dst: Path) -> Path:
    """The converted checkpoint with a `.metadata` that still is a real Metadata, but whose storage_meta creates a
    file when unpickled."""
    shutil.copytree(tiny / "mc", dst)
    metadata = pickle.loads((dst / ".metadata").read_bytes())
    metadata.storage_meta = CreatesFile(dst.parent / f"{dst.name}.pwned")
    payload = pickle.dumps(metadata)
    control = dst.parent / "control"
    metadata.storage_meta = CreatesFile(control)
    _payload_works(pickle.dumps(metadata), control)
    (dst / ".metadata").write_bytes(payload)
    return dst.parent / f"{dst.name}.pwned"


def _evil_stored_object(tiny: Path, dst: Path) -> Path:
    """The converted checkpoint whose megatron common_state object (bytes in the .distcp file) creates a file when
    unpickled: the payload is appended to the data file and the metadata points the object at it."""
    shutil.copytree(tiny / "mc", dst)
    marker = dst.parent / f"{dst.name}.pwned"
    buffer = io.BytesIO()
    torch.save([CreatesFile(marker)], buffer)
    control = dst.parent / "control"
    control_buffer = io.BytesIO()
    torch.save([CreatesFile(control)], control_buffer)
    control_buffer.seek(0)
    torch.load(control_buffer, weights_only=False)
    assert control.exists()
    control.unlink()
    metadata = pickle.loads((dst / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == COMMON_STATE_KEY)
    info = metadata.storage_data[index]
    data_file = dst / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as handle:
        handle.write(buffer.getvalue())
    info.offset, info.length = offset, len(buffer.getvalue())
    (dst / ".metadata").write_bytes(pickle.dumps(metadata))
    return marker


# -- 14: untrusted torch_dist files run no code ---------------------------------------------------------------------

@pytest.mark.parametrize("command", ["mcore-to-hf", "verify", "train-config"])
def test_hardening_14_malicious_metadata_runs_no_code(tiny, tmp_path, capsys, command):
    marker = _evil_metadata(tiny, tmp_path / "mc")
    if command == "mcore-to-hf":
        code, err = _run("checkpoints_tools", "mcore-to-hf", "--mcore-dir", str(tmp_path / "mc"),
                         "--out-dir", str(tmp_path / "out"), "--no-progress")
    elif command == "verify":
        code, err = _main(capsys, "checkpoints_tools", "verify", "--hf-dir", str(tiny / "hf"), "--mcore-dir",
                          str(tmp_path / "mc"))
    else:  # `mpo train` validates model.mcore_dir with the same reader before any rank starts
        code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE),
                          f"model.mcore_dir={tmp_path / 'mc'}")
    line = _one_line(err)
    assert code == 2, err
    assert "refusing to load global _io.open" in line and ".metadata" in line, line
    assert not marker.exists(), "the pickle in .metadata ran"
    assert not (tmp_path / "out").exists()


def test_hardening_14_malicious_stored_object_runs_no_code_in_verify(tiny, tmp_path, capsys):
    marker = _evil_stored_object(tiny, tmp_path / "mc")
    code, err = _main(capsys, "checkpoints_tools", "verify", "--hf-dir", str(tiny / "hf"), "--mcore-dir",
                      str(tmp_path / "mc"))
    line = _one_line(err)
    assert code == 2, err
    assert "not plain data" in line and COMMON_STATE_KEY in line, line
    assert not marker.exists(), "the pickled common_state object ran"


@pytest.mark.parametrize("payload", ["metadata", "stored_object"])
def test_hardening_14_megatron_load_used_by_trainer_and_engine_runs_no_code(tiny, tmp_path, payload):
    """mpo.safe_load.load_sharded is the call the trainer (model.mcore_dir), the mpo engine and verify's ranks make:
    megatron's dist_checkpointing.load with the safe reader. Both payloads fail before megatron needs a process
    group, so an empty sharded state dict is enough here."""
    from mpo.safe_load import CheckpointFileError, load_sharded

    make = _evil_metadata if payload == "metadata" else _evil_stored_object
    marker = make(tiny, tmp_path / "mc")
    with pytest.raises(CheckpointFileError) as info:
        load_sharded({}, tmp_path / "mc")
    assert "\n" not in str(info.value) and str(tmp_path / "mc") in str(info.value)
    assert not marker.exists()


def test_hardening_14_real_metadata_loads_with_the_restricted_unpickler(tiny):
    """The allow-list admits what the converter writes: same Metadata as plain pickle gives."""
    from mpo.safe_load import read_dcp_metadata

    safe = read_dcp_metadata(tiny / "mc" / ".metadata")
    plain = pickle.loads((tiny / "mc" / ".metadata").read_bytes())
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert safe.storage_data == plain.storage_data and len(safe.storage_data) > 50


# -- 15: killed and concurrent conversions --------------------------------------------------------------------------

def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_hardening_15_stale_temp_of_a_dead_converter_is_removed(tiny, tmp_path, capsys):
    stale = tmp_path / f".mc.tmp-{_dead_pid()}"
    (stale / "junk").mkdir(parents=True)
    (stale / "junk" / "__0_0.distcp").write_bytes(b"x" * 1000)
    live = tmp_path / f".mc.tmp-{os.getppid()}"  # a running process (pytest's parent): not ours to remove
    live.mkdir()
    code, err = _main(capsys, "checkpoints_tools", "hf-to-mcore", "--hf-dir", str(tiny / "hf"), "--out-dir",
                     str(tmp_path / "mc"), "--no-progress")
    assert code == 0, err
    assert not stale.exists(), "a dead converter's temporary directory was left"
    assert live.exists()
    assert (tmp_path / "mc" / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["mc", live.name]), "lock or temp files left"


def test_hardening_15_second_converter_fails_naming_the_holder(tiny, tmp_path):
    """The first converter is this test process holding the target's lock (flock on `.mc.lock`, its PID inside),
    exactly as a running converter does."""
    lock_path = tmp_path / ".mc.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(str(os.getpid()))
        lock.flush()
        code, err = _run("checkpoints_tools", "hf-to-mcore", "--hf-dir", str(tiny / "hf"), "--out-dir",
                         str(tmp_path / "mc"), "--no-progress")
    line = _one_line(err)
    assert code == 2, err
    assert f"another conversion (pid {os.getpid()})" in line and str(tmp_path / "mc") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mc.lock"], "the second converter left files"


# -- 16: one line for every bad input -------------------------------------------------------------------------------

def _hf_copy(tiny: Path, tmp_path: Path) -> Path:
    return shutil.copytree(tiny / "hf", tmp_path / "hf")


def _single_file_hf(tiny: Path, tmp_path: Path) -> Path:
    return tiny_qwen3_moe(tmp_path / "hf", max_shard_size="1GB")


def _case_truncated_single_safetensors(tiny, tmp_path):
    hf = _single_file_hf(tiny, tmp_path)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    return ["hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], "model.safetensors"


def _case_corrupt_shard(tiny, tmp_path):
    hf = _hf_copy(tiny, tmp_path)
    shard = sorted(hf.glob("model-*.safetensors"))[2]
    shard.write_bytes(b"\x07" * 64)
    return ["hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], shard.name


def _case_invalid_config_json(tiny, tmp_path):
    hf = _hf_copy(tiny, tmp_path)
    (hf / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"],\n "hidden_size": 64,,}')
    return ["hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], "line 2"


def _case_hidden_size_string(tiny, tmp_path):
    hf = _hf_copy(tiny, tmp_path)
    config = json.loads((hf / "config.json").read_text())
    config["hidden_size"] = "abc"
    (hf / "config.json").write_text(json.dumps(config))
    return ["hf-to-mcore", "--hf-dir", str(hf), "--out-dir", str(tmp_path / "out")], "hidden_size='abc'"


def _case_corrupt_metadata(tiny, tmp_path):
    mc = shutil.copytree(tiny / "mc", tmp_path / "mc")
    data = (mc / ".metadata").read_bytes()
    (mc / ".metadata").write_bytes(data[: len(data) // 3])
    return ["mcore-to-hf", "--mcore-dir", str(mc), "--out-dir", str(tmp_path / "out")], ".metadata"


def _case_corrupt_distcp(tiny, tmp_path):
    mc = shutil.copytree(tiny / "mc", tmp_path / "mc")
    data_file = next(mc.glob("*.distcp"))
    data = bytearray(data_file.read_bytes())
    data[: len(data) // 2] = b"\x00" * (len(data) // 2)
    data_file.write_bytes(bytes(data))
    return ["mcore-to-hf", "--mcore-dir", str(mc), "--out-dir", str(tmp_path / "out")], data_file.name


def _case_verify_corrupt_distcp(tiny, tmp_path):
    """Tensor data is only read inside verify's megatron ranks: the one line comes back from a spawned rank."""
    mc = shutil.copytree(tiny / "mc", tmp_path / "mc")
    metadata = pickle.loads((mc / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "embedding.word_embeddings.weight")
    with open(mc / info.relative_path, "r+b") as handle:  # garble one tensor chunk, keep the stored objects
        handle.seek(info.offset)
        handle.write(b"\x00" * info.length)
    return ["verify", "--hf-dir", str(tiny / "hf"), "--mcore-dir", str(mc)], "corrupt or unreadable torch_dist data"


def _case_output_is_a_file(tiny, tmp_path):
    (tmp_path / "out").write_text("not a directory")
    return ["hf-to-mcore", "--hf-dir", str(tiny / "hf"), "--out-dir", str(tmp_path / "out")], "not a directory"


def _case_output_under_a_file(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    return ["hf-to-mcore", "--hf-dir", str(tiny / "hf"), "--out-dir", str(tmp_path / "file" / "out")], "file"


def _case_read_only_output_parent(tiny, tmp_path):
    if os.geteuid() == 0:  # root ignores permission bits; sysfs refuses new files even to root
        parent = Path("/sys")
    else:
        parent = tmp_path / "ro"
        parent.mkdir()
        parent.chmod(0o555)
    return ["hf-to-mcore", "--hf-dir", str(tiny / "hf"), "--out-dir", str(parent / "mc-hardening")], str(parent)


def _case_verify_tp3(tiny, tmp_path):
    return ["verify", "--hf-dir", str(tiny / "hf"), "--mcore-dir", str(tiny / "mc"), "--tp", "3"], \
        "tensor_parallel=3 does not divide num_attention_heads=4"


def _case_verify_missing_directory(tiny, tmp_path):
    return ["verify", "--hf-dir", str(tiny / "hf"), "--mcore-dir", str(tmp_path / "missing")], "does not exist"


CONVERTER_CASES = {
    "truncated-safetensors": _case_truncated_single_safetensors,
    "corrupt-safetensors-shard": _case_corrupt_shard,
    "invalid-config-json": _case_invalid_config_json,
    "hidden-size-string": _case_hidden_size_string,
    "corrupt-metadata": _case_corrupt_metadata,
    "corrupt-distcp": _case_corrupt_distcp,
    "verify-corrupt-distcp": _case_verify_corrupt_distcp,
    "output-is-a-file": _case_output_is_a_file,
    "output-under-a-file": _case_output_under_a_file,
    "read-only-output": _case_read_only_output_parent,
    "verify-tp3": _case_verify_tp3,
    "verify-missing-dir": _case_verify_missing_directory,
}


@pytest.mark.parametrize("case", list(CONVERTER_CASES))
def test_hardening_16_converter_bad_input_is_one_line_exit_2(tiny, tmp_path, capsys, case):
    """Exit 2 is "bad input"; verify's "out of tolerance" is 1 and an internal error 3, so they cannot be confused."""
    args, expected = CONVERTER_CASES[case](tiny, tmp_path)
    try:
        code, err = _main(capsys, "checkpoints_tools", *args, *(["--no-progress"] if args[0] != "verify" else []))
    finally:
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o755)
    line = _one_line(err)
    assert code == 2, err
    assert expected in line, line
    assert not (tmp_path / "out").is_dir(), "partial output left"
    assert not [p for p in tmp_path.rglob(".*tmp-*")], "temporary directory left"


def test_hardening_16_verify_help_documents_exit_codes(capsys):
    from checkpoints_tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "1 verify ran and is out of tolerance" in text and "2 bad input" in text, text


def _bad_utf8(tmp_path: Path) -> list[str]:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(RECIPE.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    return ["--config", str(path)]


def _out_dir_is_a_file(tmp_path: Path) -> list[str]:
    """`mpo train` with logging.out_dir naming a file: creating the run directory fails before torchrun starts."""
    (tmp_path / "runs").write_text("a file")
    return ["--config", str(RECIPE), f"logging.out_dir={tmp_path / 'runs'}"]


CONFIG_CASES = {
    "override-not-yaml": ("check-config", lambda tmp: ["--config", str(RECIPE), "schedule.steps=[1"],
                          "mpo: config error: override 'schedule.steps=[1': the value is not valid YAML"),
    "non-utf8-config": ("check-config", _bad_utf8, "mpo: config error: config file", "latin1.yaml: not UTF-8"),
    "loss-args-type": ("check-config", lambda tmp: ["--config", str(RECIPE), "algorithm.loss_args={eps_high: abc}"],
                       "mpo: config error: algorithm.loss_args.eps_high='abc': expected float"),
    "train-out-dir-is-a-file": ("train", _out_dir_is_a_file, "mpo: error: File exists"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_hardening_16_config_bad_input_is_one_line(tmp_path, capsys, case):
    command, make_args, prefix, *more = CONFIG_CASES[case]
    code, err = _main(capsys, "mpo.cli", command, *make_args(tmp_path))
    line = _one_line(err)
    assert code == 2, err
    assert line.startswith(prefix) and all(text in line for text in more), line


# -- 17: values out of range are rejected up front ------------------------------------------------------------------

OUT_OF_RANGE = {
    "schedule.lr=-1": "schedule.lr=-1.0; valid values: > 0",
    "schedule.lr=.nan": "schedule.lr=nan; valid values: > 0",
    "rollout.temperature=-1": "rollout.temperature=-1.0; valid values: >= 0",
    "rollout.top_p=5": "rollout.top_p=5.0; valid values: in (0, 1]",
    "algorithm.kl_coef=-1": "algorithm.kl_coef=-1.0; valid values: >= 0",
    "logging.checkpoint_every=-1": "logging.checkpoint_every=-1; valid values: >= 0",
    "rollout.request_timeout_s=-5": "rollout.request_timeout_s=-5.0; valid values: > 0",
    "data.digits=0": "data.digits=0; valid values: >= 1",
    "sync.bucket_mb=0": "sync.bucket_mb=0; valid values: >= 1",
}


@pytest.mark.parametrize("override", list(OUT_OF_RANGE))
def test_hardening_17_out_of_range_value_is_rejected(capsys, override):
    code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), override)
    line = _one_line(err)
    assert code == 2, err
    assert line == f"mpo: config error: {OUT_OF_RANGE[override]}" or \
        line.startswith(f"mpo: config error: {OUT_OF_RANGE[override]} "), line


def test_hardening_17_empty_yaml_says_it_is_empty(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing here\n")
    code, err = _run("mpo.cli", "check-config", "--config", str(tmp_path / "empty.yaml"))
    line = _one_line(err)
    assert code == 2, err
    assert "empty.yaml is empty" in line, line


# -- a `latest` pointer that names nothing loadable (issue #24, class 3) ---------------------------------------------
def _checkpoint_dirs(root: Path, steps: list[int]) -> None:
    from mpo.trainer.dist_checkpoint import TRAINER_STATE

    for step in steps:
        (root / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (root / "checkpoints" / f"step_{step}" / TRAINER_STATE).write_text(json.dumps({"step": step}))
    (root / "checkpoints" / "step_9.tmp").mkdir(parents=True, exist_ok=True)  # an unfinished save: never chosen


@pytest.mark.parametrize("pointer", ["../../../../etc", "", "\x00\xff garbage", "step_6", "step_4/../../..", "fifo",
                                     "dir"])
def test_hardening_bad_latest_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path, caplog, pointer):
    """Before: anything but a loadable step made latest() return None, and the run silently restarted from step 0,
    rewriting metrics.jsonl. Now: the newest complete checkpoint, with a warning naming the pointer."""
    import logging

    from mpo.trainer.dist_checkpoint import DistCheckpointer

    _checkpoint_dirs(tmp_path, [2, 4])
    latest = tmp_path / "checkpoints" / "latest"
    if pointer == "fifo":
        os.mkfifo(latest)  # reading it would block forever
    elif pointer == "dir":
        latest.mkdir()
    else:
        latest.write_bytes(pointer.encode("utf-8", errors="surrogateescape"))
    with caplog.at_level(logging.WARNING):
        assert DistCheckpointer(tmp_path).latest() == tmp_path / "checkpoints" / "step_4"
    assert "resuming from the newest complete checkpoint, step_4" in caplog.text


def test_hardening_latest_pointer_is_followed_and_absent_means_a_fresh_run(tmp_path):
    from mpo.trainer.dist_checkpoint import DistCheckpointer

    _checkpoint_dirs(tmp_path, [2, 4])
    assert DistCheckpointer(tmp_path).latest() is None  # no pointer: the run never committed a checkpoint
    (tmp_path / "checkpoints" / "latest").write_text("step_2\n")
    assert DistCheckpointer(tmp_path).latest() == tmp_path / "checkpoints" / "step_2"


def test_hardening_bad_latest_with_nothing_to_resume_is_one_line_not_a_restart(tmp_path):
    """`mpo demo` into a run directory whose pointer names nothing and that holds no complete checkpoint: one line,
    exit non-zero, and metrics.jsonl untouched (before: a fresh run from step 0 over it)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("../../../../etc")
    (out / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    run = subprocess.run([sys.executable, "-m", "mpo.cli", "demo", "--steps", "2", "--out", str(out),
                          "logging.progress=false", "eval.every=0", "schedule.sft_steps=0"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "checkpoint error" in line]
    assert errors and "refusing to restart the run from step 0" in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "reward_mean": 0.5}\n'


# -- storage entries inside `.metadata` (issue #24, class 3) --------------------------------------------------------
def _retarget(tiny: Path, dst: Path, case: str) -> str:
    """The converted checkpoint with its common_state object's storage entry pointed at something hostile; returns
    what the one-line refusal must say."""
    shutil.copytree(tiny / "mc", dst)
    metadata = pickle.loads((dst / ".metadata").read_bytes())
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == COMMON_STATE_KEY)
    size = (dst / info.relative_path).stat().st_size
    if case == "dev_zero":  # 64 MiB here (the 3 GiB read the same way, just longer)
        info.relative_path, info.offset, info.length = "/dev/zero", 0, 64 << 20
        want = "'/dev/zero', outside the checkpoint directory"
    elif case == "outside":  # a real data file, but one of another directory
        shutil.copy(dst / info.relative_path, dst.parent / "elsewhere.distcp")
        info.relative_path = "../elsewhere.distcp"
        want = "outside the checkpoint directory"
    elif case == "fifo":  # reading it blocked every rank forever
        os.mkfifo(dst / "pipe.distcp")
        info.relative_path = "pipe.distcp"
        want = "'pipe.distcp', not a regular file"
    elif case == "past_end":
        info.offset, info.length = size - 10, 1 << 30
        want = f"which has {size}"
    else:  # a missing shard file
        (dst / info.relative_path).unlink()
        want = f"missing shard file {info.relative_path!r}"
    (dst / ".metadata").write_bytes(pickle.dumps(metadata))
    return want


@pytest.mark.parametrize("case", ["dev_zero", "outside", "fifo", "past_end", "missing"])
def test_hardening_storage_entries_are_checked_before_any_read(tiny, tmp_path, case):
    """load_sharded (trainer resume, model.mcore_dir, the engine, verify) refuses a `.metadata` whose storage entries
    name a file outside the checkpoint, a device or FIFO, bytes past a file's end or a missing shard, in one line and
    before reading anything. A FIFO blocked before the fix: the load runs in a thread, and a FIFO reader still
    blocked after 30 s is released by opening the pipe for writing (so the failure shows and the test cannot hang)."""
    import threading

    from mpo.safe_load import CheckpointFileError, load_sharded

    want = _retarget(tiny, tmp_path / "mc", case)
    outcome: list = []

    def load() -> None:
        try:
            load_sharded({}, tmp_path / "mc")
            outcome.append("loaded")
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive() and case == "fifo":
        os.close(os.open(tmp_path / "mc" / "pipe.distcp", os.O_WRONLY | os.O_NONBLOCK))
        reader.join(30)
        outcome.insert(0, "blocked on the FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointFileError), outcome
    message = str(outcome[0])
    assert "\n" not in message and want in message and str(tmp_path / "mc") in message, message


def test_hardening_storage_entry_outside_is_refused_by_check_config(tiny, tmp_path, capsys):
    """`mpo train` checks model.mcore_dir before any rank starts: a storage entry naming /dev/zero is one line."""
    _retarget(tiny, tmp_path / "mc", "dev_zero")
    code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), f"model.mcore_dir={tmp_path / 'mc'}")
    line = _one_line(err)
    assert code == 2 and "outside the checkpoint directory" in line, err


# -- config values that are huge (issue #24, class 7) ---------------------------------------------------------------
def _alias_bomb(path: Path, levels: int) -> Path:
    """Nine aliases of nine aliases, `levels` deep, under a dict-typed field (so they pass the unknown-field check),
    quoted in an error by a string field that names the last one: 9**levels values from ~70 bytes a level."""
    text = "algorithm:\n  advantage_args:\n    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for i in range(1, levels + 1):
        text += f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n"
    path.write_text(text + f"model:\n  preset: *a{levels}\n")
    return path


def test_hardening_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path, capsys):
    """Before: this 600-byte file (7 levels, 4.8M values) made a 312 MB "one-line" error (seen: len 312,088,776).
    Now the expansion is measured on the node graph and refused before any object is built."""
    bomb = _alias_bomb(tmp_path / "bomb.yaml", 7)
    assert bomb.stat().st_size < 900
    code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(bomb))
    line = _one_line(err)
    assert code == 2 and len(line) < 400, line[:400]
    assert "bomb.yaml" in line and "aliases expand to more than" in line, line[:400]


def test_hardening_huge_value_is_quoted_short(capsys):
    """A 1 MB override value is named in the error, cut to a few hundred characters (it was echoed whole)."""
    code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), "model.preset=" + "x" * (1 << 20))
    line = _one_line(err)
    assert code == 2 and len(line) < 400, line[:400]
    assert line.startswith("mpo: config error: model.preset='xxxx") and "valid values: tiny" in line, line[:400]


@pytest.mark.parametrize("form", ["directory", "recursive-glob"])
def test_hardening_dataset_in_subdirectories_passes_check_config_as_the_reader_reads_it(tmp_path, capsys, form):
    """A dataset directory whose files sit in subdirectories: the reader (mpo.data.sources) reads them recursively,
    and check-config refused the directory as holding no data file."""
    from mpo.data.sources import open_source

    (tmp_path / "data" / "train" / "part1").mkdir(parents=True)
    (tmp_path / "data" / "train" / "part1" / "rows.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    task = str(tmp_path / "data") if form == "directory" else str(tmp_path / "data" / "**" / "*.jsonl")
    assert open_source(task).row(0).answer == "2"
    code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), f"data.task={task}",
                      f"model.tokenizer_dir={tmp_path}", "reward.fn=math")
    assert code == 0, err


# -- model sizes against this machine's memory (issue #24, class 7) --------------------------------------------------
def _huge_vocab_hf(tiny: Path, tmp_path: Path) -> Path:
    """The tiny model's config.json with a 10^9-token vocabulary (no weights: nothing reads them before the check)."""
    config = json.loads((tiny / "hf" / "config.json").read_text())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "vocab_size": 10**9}))
    return tmp_path / "hf"


def test_hardening_huge_vocab_is_refused_by_check_config(tiny, tmp_path, capsys):
    """check-config accepted a model whose embedding alone is 256 GB per rank; now it compares the model state of
    every rank (and engine) on this host with the host's memory."""
    hf = _huge_vocab_hf(tiny, tmp_path)
    code, err = _main(capsys, "mpo.cli", "check-config", "--config", str(RECIPE), f"model.hf_dir={hf}")
    line = _one_line(err)
    assert code == 2, err
    assert "does not fit in this host's memory" in line and "vocab_size=1,000,000,000" in line, line


def test_hardening_huge_vocab_train_stops_before_any_rank_allocates(tiny, tmp_path, capsys):
    """`mpo train` with the same model: one line before torchrun starts (before, every rank tried to allocate
    256 GB). Runs in this process with its address space capped at 3 GiB above what it uses now (torchrun and the
    ranks would inherit the cap), so that a regression fails here instead of swapping the machine."""
    import resource

    hf = _huge_vocab_hf(tiny, tmp_path)
    with open("/proc/self/statm") as statm:
        used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + (3 << 30), hard))
    try:
        code, err = _main(capsys, "mpo.cli", "train", "--config", str(RECIPE), f"model.hf_dir={hf}",
                          f"logging.out_dir={tmp_path / 'run'}")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    line = _one_line(err)
    assert code == 2 and "does not fit in this host's memory" in line, err[-2000:]
    assert not (tmp_path / "run").exists()


def test_hardening_huge_vocab_against_one_gpu_and_the_demo_fits(tiny, tmp_path):
    """On a GPU machine the bound is one rank's model state against one GPU (here an 80 GB one, given); the demo
    itself fits both ways."""
    from mpo.config import ConfigError
    from mpo.config_checks import load_config
    from mpo.memory_plan import check_fits_here

    huge = load_config(RECIPE, [f"model.hf_dir={_huge_vocab_hf(tiny, tmp_path)}"])
    with pytest.raises(ConfigError, match="does not fit on this GPU: one trainer rank holds at least"):
        check_fits_here(huge, gpu_bytes=80 * 10**9)
    check_fits_here(load_config(RECIPE), gpu_bytes=80 * 10**9)
    check_fits_here(load_config(RECIPE), host_bytes=1 << 30)
