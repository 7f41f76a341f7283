"""The config loader (`streaming.config.load_config` / `apply_overrides`) on random overrides of real
and made-up keys and on random TOML files: a `StreamRLConfig` or a `ValueError` with a message, never
another exception."""

from __future__ import annotations

import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from streamrl.streaming.config import StreamRLConfig, load_config


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        for arg in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths += _field_paths(arg, f"{path}.")
    return paths


KEYS = _field_paths(StreamRLConfig)
KEY = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + ".x"),
    st.text(st.characters(codec="ascii", exclude_characters="="), max_size=20),
)
# TOML literals of every type, edge values and malformed ones (a bare word is taken as a string).
VALUE = st.one_of(
    st.sampled_from(
        [
            "0",
            "-1",
            "1",
            "true",
            "false",
            "nan",
            "inf",
            "-inf",
            "1e309",
            "0.0",
            '""',
            "[]",
            "{}",
            "[1, 2]",
            '["a"]',
            "{a = 1}",
            "1" * 5000,
            "[[[[",
            "{a=",
            '"unterminated',
            "null",
            "None",
        ]
    ),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True).map(repr),
    st.text(max_size=20),
)
OVERRIDES = st.lists(st.tuples(KEY, VALUE).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=20), max_size=6)


def _load(path, overrides):
    try:
        cfg = load_config(path, overrides)
    except ValueError as e:
        assert str(e), "a ValueError must say what is wrong"
        return None
    assert isinstance(cfg, StreamRLConfig)
    return cfg


@pytest.mark.timeout(180)
@settings(max_examples=300, deadline=5000, derandomize=True)
@given(overrides=OVERRIDES)
def test_random_overrides_give_a_config_or_a_value_error(overrides):
    _load(None, overrides)


def _toml_value(value) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


SCALAR = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(st.characters(codec="ascii", categories=["L", "N"]), max_size=10),
)
SECTION = st.sampled_from([k for k in KEYS if "." not in k])
DOCUMENT = st.dictionaries(
    SECTION,
    st.dictionaries(
        st.one_of(
            st.sampled_from(KEYS).map(lambda k: k.rsplit(".", 1)[-1]), st.from_regex(r"[a-z_]{1,12}", fullmatch=True)
        ),
        st.one_of(SCALAR, st.lists(SCALAR, max_size=3)),
        max_size=5,
    ),
    max_size=4,
)


@pytest.mark.timeout(180)
@settings(
    max_examples=200, deadline=5000, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    doc=DOCUMENT,
    noise=st.one_of(st.just(""), st.text(max_size=30), st.binary(max_size=30).map(lambda b: b.decode("latin-1"))),
)
def test_random_toml_files_give_a_config_or_a_value_error(tmp_path, doc, noise):
    text = "".join(
        f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())
        for section, table in doc.items()
    )
    path = tmp_path / "run.toml"
    path.write_bytes((text + noise).encode("utf-8", "surrogatepass"))
    _load(path, [])


@pytest.mark.timeout(60)
@settings(
    max_examples=100, deadline=5000, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=200))
def test_random_bytes_as_a_config_file_give_a_value_error(tmp_path, data):
    path = tmp_path / "run.toml"
    path.write_bytes(data)
    _load(path, [])
