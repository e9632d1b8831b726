"""mpo.rollout.shared_memory: the shared files behind CPU weight sync (real /dev/shm, real processes, a real small
tmpfs for the full case when the tests run as root)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

from mpo.rollout import shared_memory as shm


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
        with pytest.raises(OSError):  # O_NOFOLLOW
            shm.read_view({**loc, "path": str(link)})
        with pytest.raises(ValueError, match="is not an mpo-sync-\\* file"):
            shm.read_view({**loc, "path": str(shm.shm_dir() / "other-file")})
        with pytest.raises(ValueError, match="is not an mpo-sync-\\* file"):
            shm.read_view({**loc, "path": f"{shm.shm_dir()}/../{os.path.basename(real.path)}"})
        with pytest.raises(ValueError, match="must be lists"):
            shm.read_view({**loc, "offset": -1})
    finally:
        link.unlink()
        real.close()


def test_files_of_a_killed_creator_are_removed_by_the_next_one():
    token = shm.new_token()
    code = (f"import torch, os, signal; from mpo.rollout import shared_memory as s; "
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
