"""mpo.weight_sync.shared_memory: the shared files behind CPU weight sync (real /dev/shm, real processes, a real small
tmpfs for the full case when the tests run as root)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from mpo.weight_sync import shared_memory as shm


def test_a_mapping_sees_the_creators_writes_and_the_file_goes_with_its_creator():
    token = shm.new_token()
    created = shm.SharedBuffer(shm.file_name(token, "a"), 1000, torch.float32, create=True)
    mapped = shm.SharedBuffer(shm.file_name(token, "a"), None, torch.float32, create=False)
    assert mapped.numel == 1000
    created.tensor[10:20] = torch.arange(10.0)
    assert torch.equal(mapped.tensor[10:20], torch.arange(10.0))
    view = created.tensor[100:160].view(6, 10)[:, 2:5]  # strided, as a row-parallel slice
    loc = shm.locate("w", view)
    assert loc is not None and loc.path == created.path and loc.stride == (10, 1) and loc.offset == 102
    view.fill_(3.0)
    assert torch.equal(shm.read_view(loc.to_json(), expected_shape=(6, 3)), torch.full((6, 3), 3.0))
    assert shm.locate("x", torch.zeros(3)) is None  # not in a shared buffer
    mapped.close()
    assert os.path.exists(created.path)  # a mapper never unlinks
    created.close()
    assert not os.path.exists(created.path)


def test_read_view_refuses_symlinks_and_foreign_names(tmp_path):
    token = shm.new_token()
    real = shm.SharedBuffer(shm.file_name(token, "b"), 16, torch.float32, create=True)
    link = shm.shm_dir() / shm.file_name(token, "link")
    os.symlink(real.path, link)
    try:
        loc = shm.locate("w", real.tensor[:4]).to_json()
        # the same refusals with an engine's session cache that already holds the good slot (checked once per path)
        for cache in (None, {}):
            if cache is not None:
                real.tensor[:4] = 7.0
                assert torch.equal(shm.read_view(loc, cache=cache), torch.full((4,), 7.0))
                assert torch.equal(shm.read_view(loc, cache=cache), torch.full((4,), 7.0))
            with pytest.raises(OSError):  # O_NOFOLLOW
                shm.read_view({**loc, "path": str(link)}, cache=cache)
            with pytest.raises(ValueError, match="is not an mpo-sync-\\* file"):
                shm.read_view({**loc, "path": str(shm.shm_dir() / "other-file")}, cache=cache)
            with pytest.raises(ValueError, match="is not an mpo-sync-\\* file"):
                shm.read_view({**loc, "path": f"{shm.shm_dir()}/../{os.path.basename(real.path)}"}, cache=cache)
            with pytest.raises(ValueError, match="must be lists"):
                shm.read_view({**loc, "offset": -1}, cache=cache)
            with pytest.raises(ValueError, match="the view ends at element 16 but"):  # past the slot's end
                shm.read_view({**loc, "offset": 16, "shape": [1], "stride": [1]}, cache=cache)
    finally:
        link.unlink()
        real.close()


def test_files_of_a_killed_creator_are_removed_by_the_next_one():
    token = shm.new_token()
    code = (f"import torch, os, signal; from mpo.weight_sync import shared_memory as s; "
            f"b = s.SharedBuffer(s.file_name({token!r}, 'slot'), 1024, torch.float32, create=True); "
            f"print(b.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    orphan = done.stdout.strip()
    assert done.returncode == -9 and os.path.exists(orphan), done.stderr[-2000:]
    mine = shm.SharedBuffer(shm.file_name(token, "live"), 8, torch.float32, create=True)  # sweeps dead creators
    try:
        assert not os.path.exists(orphan)
        assert os.path.exists(mine.path)  # a live creator's file stays
    finally:
        mine.close()


def test_a_full_shm_directory_fails_at_creation_with_the_size_and_the_remedy(tmp_path, monkeypatch):
    """A real 1 MiB tmpfs as MPO_SHM_DIR: a 4 MiB slot fails with ENOSPC at creation (preallocated), not with SIGBUS
    when a holder writes into it later. Mounting needs root (CI runs as root)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        monkeypatch.setenv("MPO_SHM_DIR", str(where))
        with pytest.raises(OSError, match="no space in .* for a 4 MiB weight-sync slot .*--shm-size") as info:
            shm.SharedBuffer(shm.file_name(shm.new_token(), "big"), 1 << 20, torch.float32, create=True)
        assert info.value.errno == errno.ENOSPC
        assert os.listdir(where) == []  # the partial file is gone
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_hardening_orphan_sweep_keeps_a_live_creator_of_another_pid_namespace():
    """A trainer in another PID namespace sharing the directory (a container with --ipc=host) names its files with a
    pid that means nothing here (simulated: a live creator whose file carries a pid that does not exist in this
    namespace). The sweep must judge it by the creator's lock, not by the pid: its slot stays; once the creator is
    killed, the next creation removes it."""
    token = shm.new_token()
    code = (f"import sys, torch; from mpo.weight_sync import shared_memory as s; "
            f"b = s.SharedBuffer(s.file_name({token!r}, 'slot', pid=2**22 + 7), 1024, torch.float32, create=True); "
            f"print(b.path, flush=True); sys.stdin.read()")
    creator = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        live = creator.stdout.readline().strip()
        assert live and os.path.exists(live)
        mine = shm.SharedBuffer(shm.file_name(token, "sweeper"), 8, torch.float32, create=True)  # sweeps
        mine.close()
        assert os.path.exists(live), "the sweep deleted the live slot of another namespace's trainer"
    finally:
        creator.kill()
        creator.wait(30)
    mine = shm.SharedBuffer(shm.file_name(token, "sweeper"), 8, torch.float32, create=True)
    mine.close()
    assert not os.path.exists(live)


def test_hardening_a_fifo_named_like_a_slot_is_refused_without_blocking():
    """open() of a FIFO blocks until a writer comes: read_view and the sweep must not open it blocking."""
    import threading

    token = shm.new_token()
    fifo = shm.shm_dir() / shm.file_name(token, "fifo", pid=1)
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            shm.read_view({"name": "w", "path": str(fifo), "dtype": "float32", "shape": [4], "stride": [1],
                           "offset": 0})
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(5)
        blocked = reader.is_alive()
        shm.remove_orphans()  # the sweep's open must not block either (it would here, before the fix)
    finally:
        try:
            for _ in range(2):  # releases a reader blocked in open()
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        fifo.unlink()
    assert not blocked, "read_view blocked opening a FIFO"
    assert isinstance(outcome[0], ValueError) and "not a regular file" in str(outcome[0]), outcome


def test_hardening_a_full_shm_directory_ends_the_trainer_with_one_line(tmp_path):
    """A real 256 KiB tmpfs as MPO_SHM_DIR and a 512 KiB slot, created inside the trainer's entry point (its run()
    replaced by the slot creation): the rank stops with one line naming the real size (not "0 MiB") and the room
    left, no traceback. Mounting needs root (CI runs as root)."""
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    code = ("import sys, types, torch; from mpo.weight_sync import shared_memory as s\n"
            "loop = types.ModuleType('mpo.trainer.loop')\n"
            "loop.run = lambda config: s.SharedBuffer(s.file_name('ab12', 'slot'), 128 << 10, torch.float32, "
            "create=True)\n"
            "sys.modules['mpo.trainer.loop'] = loop\n"
            "from mpo.trainer.__main__ import main\n"
            "main([])\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, "MPO_SHM_DIR": str(where), "PYTHONPATH": os.pathsep.join(sys.path)})
        print(f"\n[full shm] exit {run.returncode}: {run.stderr.strip()[-600:]}", file=sys.stderr)
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mpo: no space in "), run.stderr[-2000:]
        assert "512 KiB weight-sync slot" in lines[0] and "free" in lines[0] and "--shm-size" in lines[0], lines[0]
        assert os.listdir(where) == []
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
