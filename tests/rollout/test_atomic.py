"""Write-then-rename: a reader sees the old content or the new, and a failed write leaves no debris."""

from __future__ import annotations

import pytest

from streamrl.rollout.atomic import atomic_dir, atomic_write

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
