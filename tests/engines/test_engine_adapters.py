"""`AdapterTable`: which LoRA adapter a request names, and that an adapter is unloaded only once it is
not current and no request names it, within the engine's capacity (engines/adapters.py)."""

from __future__ import annotations

import pytest

from streamrl.engines.adapters import AdapterTable, ServedAdapter


def _adapter(version: int) -> ServedAdapter:
    return ServedAdapter(
        policy_version=version, name=f"policy-v{version}", adapter_id=version + 1, path=f"/a/{version}"
    )


def test_requests_name_the_current_adapter_and_the_base_before_the_first():
    table = AdapterTable(capacity=2)
    assert table.acquire("base") is None  # no adapter yet: the base weights serve, nothing is held for it
    assert table.release("base") == []
    assert table.commit(_adapter(1)) == []
    assert table.acquire("r1") == _adapter(1)
    with pytest.raises(ValueError, match="already names"):
        table.acquire("r1")
    assert table.commit(_adapter(2)) == []  # r1 still names v1
    assert table.acquire("r2") == _adapter(2)
    assert table.held_versions == [1, 2]


def test_an_old_adapter_is_unloaded_when_its_last_request_ends_and_not_before():
    table = AdapterTable(capacity=3)
    table.commit(_adapter(1))
    table.acquire("a")
    table.acquire("b")
    assert table.commit(_adapter(2)) == []
    assert table.release("a") == []  # b still names v1
    assert table.held_versions == [1, 2]
    assert table.release("b") == [1]
    assert table.release("b") == []  # once only
    assert table.held_versions == [2]
    assert table.release("c") == []  # the current adapter stays without requests


def test_a_commit_unloads_the_adapter_it_replaces_when_no_request_names_it():
    table = AdapterTable(capacity=2)
    table.commit(_adapter(1))
    table.acquire("a")
    table.release("a")
    assert table.held_versions == [1]  # current: kept
    assert table.make_room().unload == []
    assert table.commit(_adapter(2)) == [1]
    assert table.held_versions == [2]


def test_make_room_unloads_idle_adapters_before_ending_any_request():
    table = AdapterTable(capacity=3)
    for version, request in ((1, "a"), (2, "b"), (3, None)):
        table.commit(_adapter(version))
        if request is not None:
            table.acquire(request)
    table.release("a")  # v1 is idle now: it was already unloaded by the release
    assert table.held_versions == [2, 3]
    room = table.make_room()
    assert room.unload == [] and room.abort == []  # 2 of 3 slots taken: room for one more


def test_a_full_table_ends_the_requests_of_the_oldest_adapter_and_never_evicts_the_current():
    table = AdapterTable(capacity=2)
    table.commit(_adapter(1))
    table.acquire("a")
    table.acquire("b")
    table.commit(_adapter(2))
    table.acquire("c")  # every slot named by requests
    room = table.make_room()
    assert room.unload == [1] and sorted(room.abort) == ["a", "b"]
    assert table.held_versions == [2]
    assert table.release("a") == []  # already ended by make_room
    assert table.commit(_adapter(3)) == []  # c still names v2
    assert table.held_versions == [2, 3]


def test_a_re_commit_replaces_the_adapter_of_its_version_and_versions_only_go_up():
    table = AdapterTable(capacity=2)
    table.commit(_adapter(1))
    table.commit(_adapter(2))  # v1 idle: unloaded
    again = ServedAdapter(policy_version=2, name="policy-v2", adapter_id=3, path="/other")
    assert table.commit(again) == []
    assert table.current == again and table.held_versions == [2]
    with pytest.raises(ValueError, match="after 2"):
        table.commit(_adapter(1))


def test_capacity_below_two_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        AdapterTable(capacity=1)
