"""A rollout worker's `ImageStore` is bounded, so a long VLM run cannot grow it without end: past
`max_bytes` it forgets the least recently used images, never one a trajectory the worker holds still
needs (pinned) nor the newest few; what it forgot comes back from its directory or, in a worker, from
the buffer by hash."""

from __future__ import annotations

import pytest

from streamrl.models.images import encode_png
from streamrl.rollout import images as images_module
from streamrl.rollout.images import ImageStore
from streamrl.rollout.types import AgentData
from streamrl.rollout.worker import RolloutWorker

pytestmark = pytest.mark.timeout(60)


def _pngs(n: int) -> list[bytes]:
    from PIL import Image

    return [encode_png(Image.new("RGB", (8, 8), (i, 255 - i, 7))) for i in range(n)]


def test_the_store_forgets_the_least_recently_used_images_past_its_bound(monkeypatch):
    monkeypatch.setattr(images_module, "KEEP_NEWEST", 1)
    data = _pngs(6)
    size = len(data[0])
    assert all(len(d) == size for d in data)
    store = ImageStore(max_bytes=3 * size)
    shas = [store.put(d).sha256 for d in data[:3]]
    store.get(shas[0])  # used: now the most recent
    store.put(data[3])
    assert shas[1] not in store and shas[0] in store and shas[2] in store  # the least recently used went
    assert store.num_bytes == 3 * size and len(store) == 3 and store.num_evicted == 1
    with pytest.raises(KeyError):
        store.get(shas[1])
    for d in data:
        store.put(d)
    assert store.num_bytes <= 3 * size


def test_pinned_and_newest_images_stay_even_over_the_bound(monkeypatch):
    monkeypatch.setattr(images_module, "KEEP_NEWEST", 2)
    data = _pngs(5)
    size = len(data[0])
    pinned: set[str] = set()
    store = ImageStore(max_bytes=size, pinned=lambda: pinned)
    first = store.put(data[0]).sha256
    pinned.add(first)
    shas = [store.put(d).sha256 for d in data[1:]]
    assert first in store  # pinned: kept although the oldest
    assert shas[-2] in store and shas[-1] in store  # the newest two are never evicted
    assert shas[0] not in store and shas[1] not in store
    assert store.num_bytes == 3 * size  # over the bound by what must stay


def test_an_evicted_image_is_read_back_from_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(images_module, "KEEP_NEWEST", 0)
    data = _pngs(3)
    store = ImageStore(tmp_path, max_bytes=len(data[0]))
    shas = [store.put(d).sha256 for d in data]
    assert len(store) == 1 and store.get(shas[0]) == data[0]  # back from disk


def test_an_unbounded_store_keeps_everything():
    store = ImageStore()
    for d in _pngs(10):
        store.put(d)
    assert len(store) == 10 and store.num_evicted == 0


def test_the_worker_pins_the_images_of_every_trajectory_it_holds():
    worker = RolloutWorker(ctx=None, sink=None)
    store = ImageStore()
    refs = [store.put(d) for d in _pngs(3)]
    running = AgentData(trajectory_id="g/0", group_id="g", images=[refs[0]])
    admitted = AgentData(
        trajectory_id="g/1",
        group_id="g",
        messages=[{"role": "user", "content": [{"type": "image", "image_ref": refs[1].sha256}]}],
    )
    held = AgentData(trajectory_id="h/0", group_id="h", images=[refs[2]])
    worker._states = {running.trajectory_id: running, admitted.trajectory_id: admitted}
    worker._held = [held]
    assert worker.image_shas() == {r.sha256 for r in refs}
    worker._states = {}
    assert worker.image_shas() == {refs[2].sha256}
