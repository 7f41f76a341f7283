"""The verl prompt loader (`rollout.data.load_prompts` / `records_from_rows`) on random rows and on
random or truncated files: a list of `PromptRecord`s or a `ValueError` with a message, never another
exception."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrl.rollout.data.loaders import load_prompts, records_from_rows
from streamrl.rollout.types import PromptRecord

JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
    optional={
        "content": st.one_of(st.text(max_size=20), JSON, st.just([{"type": "text", "text": "hi"}])),
        "tool_calls": JSON,
    },
)
FIELDS = {
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), st.text(max_size=20), JSON),
    "prompt": st.one_of(st.lists(MESSAGE, max_size=3), st.text(max_size=20), JSON),
    "id": JSON,
    "uid": JSON,
    "group_id": JSON,
    "ground_truth": JSON,
    "reward_model": st.one_of(JSON, st.fixed_dictionaries({"ground_truth": JSON, "style": JSON})),
    "extra_info": st.one_of(JSON, st.text(max_size=10).map(lambda s: "{" + s)),
    "tools_kwargs": JSON,
    "interaction_kwargs": JSON,
    "agent_name": JSON,
    "data_source": JSON,
    "ability": JSON,
    "images": st.one_of(
        JSON, st.lists(st.fixed_dictionaries({}, optional={"bytes": st.binary(max_size=20), "path": JSON}), max_size=2)
    ),
    "videos": JSON,
}
ROW = st.one_of(st.fixed_dictionaries({}, optional=FIELDS), JSON)


def _parse(fn, *args):
    try:
        records = fn(*args)
    except ValueError as e:
        assert str(e), "a ValueError must say what is wrong"
        return None
    assert all(isinstance(r, PromptRecord) and r.messages for r in records)
    assert len({r.group_id for r in records}) == len(records)
    return records


@pytest.mark.timeout(180)
@settings(max_examples=300, deadline=5000, derandomize=True)
@given(rows=st.lists(ROW, max_size=4))
def test_random_rows_give_records_or_a_value_error(rows):
    _parse(records_from_rows, rows)


@pytest.mark.timeout(120)
@settings(
    max_examples=150, deadline=5000, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.lists(ROW, max_size=3).map(lambda rows: "\n".join(json.dumps(r, default=repr) for r in rows).encode()),
    ),
    suffix=st.sampled_from([".jsonl", ".json", ".parquet", ".csv"]),
)
def test_random_files_give_records_or_a_value_error(tmp_path, data, suffix):
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(data)
    _parse(load_prompts, path)


@pytest.fixture(scope="module")
def parquet_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("parquet") / "p.parquet"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"what is {i}+{i}?"}],
            "reward_model": {"ground_truth": str(2 * i)},
            "data_source": "toy",
            "extra_info": {"index": i},
        }
        for i in range(20)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


@pytest.mark.timeout(120)
@settings(
    max_examples=150, deadline=5000, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(0, 10**6), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4))
def test_truncated_or_corrupted_parquet_gives_records_or_a_value_error(tmp_path, parquet_bytes, cut, flips):
    data = bytearray(parquet_bytes[: cut % (len(parquet_bytes) + 1)])
    for pos, mask in flips:
        if data:
            data[pos % len(data)] ^= mask
    path = tmp_path / "prompts.parquet"
    path.write_bytes(bytes(data))
    _parse(load_prompts, path)
