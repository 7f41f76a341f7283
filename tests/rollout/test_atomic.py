"""Write-then-rename: a reader sees the old content or the new, and a failed write leaves no debris."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamrl.rollout.atomic import atomic_dir, atomic_write, build_once


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
