"""Write-then-rename: a reader sees the old content or the new, and a failed write leaves no debris."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamrl.core.atomic import atomic_dir, atomic_write, build_once


@pytest.mark.parametrize("sync", [False, True])
def test_atomic_write_replaces_and_cleans_up_after_a_failure(tmp_path, sync):
    path = tmp_path / "state.json"
    atomic_write(path, '{"a": 1}', sync=sync)
    atomic_write(path, b'{"a": 2}', sync=sync)
    assert path.read_text() == '{"a": 2}'

    with pytest.raises(TypeError):
        atomic_write(path, 12345, sync=sync)  # type: ignore[arg-type]  (not str/bytes: the write raises)
    assert path.read_text() == '{"a": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_atomic_dir_swaps_whole_folders_and_keeps_the_old_one_on_failure(tmp_path):
    final = tmp_path / "ckpt"
    atomic_dir(final, lambda d: (d / "a").write_text("1"))
    atomic_dir(final, lambda d: (d / "b").write_text("2"))
    assert sorted(p.name for p in final.iterdir()) == ["b"]  # replaced whole, not merged

    def fail(d):
        (d / "c").write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_dir(final, fail)
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or old folder left


def test_build_once_builds_a_shared_cache_folder_once_while_another_waits(tmp_path):
    """Two runs sharing a cache ask for one folder while the first is still building it: the second waits
    on the lock and uses the first's folder (no second build that would swap the folder away under a
    reader). Flock locks are per open file, so two threads contend exactly like two processes."""
    final = tmp_path / "sft" / "tiny-abc"
    building, builds = threading.Event(), []

    def build(tmp):
        builds.append(tmp)
        building.set()
        time.sleep(0.3)  # the other caller arrives now, before config.json exists
        (tmp / "config.json").write_text(str(len(builds)))

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(build_once, final, build)
        assert building.wait(10)
        second = pool.submit(build_once, final, build)
        assert first.result(10) == second.result(10) == final
    assert len(builds) == 1 and (final / "config.json").read_text() == "1"
    assert build_once(final, build) == final and len(builds) == 1  # built: no lock wait, no build
    build_once(final, build, rebuild=True)  # a forced rebuild replaces it whole
    assert len(builds) == 2 and (final / "config.json").read_text() == "2"


def test_atomic_dir_sync_seals_the_folder_and_fsyncs_files_then_seal_then_folders(tmp_path, monkeypatch):
    """What survives a lost machine: every file's bytes, then the seal (written last), then the
    folders' entries, then the rename in the parent. A folder with a file gone or cut is not sealed."""
    import os

    from streamrl.core.atomic import SEAL, unsealed_reason

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))

    def write(d):
        (d / "hf").mkdir()
        (d / "hf" / "model.safetensors").write_bytes(b"w" * 100)
        (d / "optimizer.pt").write_bytes(b"o" * 10)

    final = atomic_dir(tmp_path / "ckpt", write, sync=True)
    names = [os.path.relpath(p, tmp_path) for p in synced]
    tmp_name = names[0].split("/")[0]  # the temporary sibling the files were written into
    assert names == [
        f"{tmp_name}/hf/model.safetensors",
        f"{tmp_name}/optimizer.pt",
        f"{tmp_name}/{SEAL}",
        f"{tmp_name}/hf",
        tmp_name,
        ".",
    ]
    assert unsealed_reason(final) is None
    (final / "hf" / "model.safetensors").write_bytes(b"w" * 99)
    assert "99 bytes" in unsealed_reason(final)
    assert atomic_dir(tmp_path / "plain", write) and unsealed_reason(tmp_path / "plain") is not None  # no sync: no seal


def test_atomic_write_sync_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    import os

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    atomic_write(tmp_path / "driver_state.json", "{}", sync=True)
    assert (
        len(synced) == 2 and synced[0].startswith(str(tmp_path / ".driver_state.json.")) and synced[1] == str(tmp_path)
    )
