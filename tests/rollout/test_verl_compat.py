"""verl compatibility: verl's parquet layout loads unchanged (as pyarrow, pandas and HF datasets write
and hand it over), and verl-style `compute_score` functions plug in as reward functions."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.rollout.data.loaders import load_prompts, messages_hash, records_from_rows
from streamrl.rollout.rewards import (
    RewardInput,
    VerlScore,
    get_reward_fn,
    is_verl_compute_score,
    math_answer,
    verl_reward_fn,
    verl_score,
)
from streamrl.rollout.types import PromptRecord

HERE = "tests.rollout.test_verl_compat"
SYSTEM = (
    "You are a math expert. You should use the `calc_gsm8k_reward` tool after step by step solving the "
    "question. Put your final answer in the format of `#### <answer>`."
)
QUESTIONS = [
    ("Natalia sold 48 clips in April and half as many in May. How many clips did she sell?", "72"),
    ("Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?", "10"),
    ("Betty needs $100 and has half of it. Her parents give $15, grandparents twice that. How much more?", "5"),
]
INSTRUCTION = "Let's think step by step and output the final answer after `####`."


def gsm8k_multiturn_row(split: str, index: int, question: str, solution: str) -> dict:
    """One row exactly as verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": f"step by step... #### {solution}",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            "interaction_kwargs": {"query": f"{question} {INSTRUCTION}", "ground_truth": solution},
        },
    }


def verl_rows() -> list[dict]:
    rows = [gsm8k_multiturn_row("train", i, q, a) for i, (q, a) in enumerate(QUESTIONS)]
    # Variations seen in verl datasets: an agent loop named per row, an interaction named per row, and
    # a second tool in one row only (parquet then adds that key, null, to every row's struct).
    rows[1]["agent_name"] = "tool_agent"
    rows[2]["agent_name"] = "single_turn_agent"
    rows[2]["extra_info"]["interaction_kwargs"]["name"] = "gsm8k"
    rows[2]["extra_info"]["tools_kwargs"]["search"] = {"create_kwargs": {"top_k": 3}}
    return rows


def check_records(records: list[PromptRecord]) -> None:
    """Every field of verl's layout lands in the records, struct nulls gone, as plain Python."""
    rows = verl_rows()
    assert len(records) == 3 and all(isinstance(r, PromptRecord) for r in records)
    for i, (record, row) in enumerate(zip(records, rows, strict=True)):
        assert record.messages == row["prompt"] and type(record.messages) is list
        assert record.group_id == messages_hash(row["prompt"]) and record.data_index == i
        assert (record.data_source, record.ability, record.reward_style) == ("openai/gsm8k", "math", "rule")
        assert record.ground_truth == record.raw_ground_truth == QUESTIONS[i][1]
        assert record.extra_info == row["extra_info"]  # whole, as verl passes it to compute_score
        assert record.tools_kwargs == row["extra_info"]["tools_kwargs"]
        assert record.interaction_kwargs == row["extra_info"]["interaction_kwargs"]
        assert type(record.extra_info["index"]) is int and record.extra_info["need_tools_kwargs"] is True
    assert [r.agent_name for r in records] == [None, "tool_agent", "single_turn_agent"]
    assert "search" not in records[0].tools_kwargs and "name" not in records[0].interaction_kwargs
    assert records[2].interaction_kwargs["name"] == "gsm8k" and records[2].tools_kwargs["search"] == {
        "create_kwargs": {"top_k": 3}
    }


# -- datasets -----------------------------------------------------------------------------------------


def verl_table(rows: list[dict]) -> pa.Table:
    """Columns over all rows' keys, each type inferred from every row (as HF datasets writes it;
    `Table.from_pylist` would take the column names of the first row only)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return pa.table({column: pa.array([row.get(column) for row in rows]) for column in columns})


def test_verl_parquet_written_by_pyarrow_loads_unchanged(tmp_path):
    path = tmp_path / "train.parquet"
    table = verl_table(verl_rows())
    assert pa.types.is_struct(table.schema.field("extra_info").type)  # nested structs, not JSON strings
    pq.write_table(table, path)
    check_records(load_prompts(path))


def test_verl_parquet_round_tripped_through_pandas_loads_unchanged(tmp_path):
    """A verl parquet read with pandas (lists become numpy arrays, absent columns NaN) and written
    back, as people do to filter or extend a dataset; also the rows of that frame, in memory."""
    first, second = tmp_path / "first.parquet", tmp_path / "second.parquet"
    pd.DataFrame(verl_rows()).to_parquet(first)
    frame = pd.read_parquet(first)
    in_memory = frame.to_dict("records")
    assert isinstance(in_memory[0]["prompt"], np.ndarray)  # what a parquet round trip hands over
    assert in_memory[0]["agent_name"] is None or pd.isna(in_memory[0]["agent_name"])
    frame.to_parquet(second)
    check_records(load_prompts(second))
    check_records(records_from_rows(in_memory, "frame"))
    check_records(records_from_rows(pd.DataFrame(verl_rows()).to_dict("records"), "fresh frame"))  # NaN agent_name


def test_structured_ground_truth_is_kept_raw_for_verl_scorers(tmp_path):
    """search-R1 style rows store `reward_model.ground_truth` as a struct; the text form is JSON."""
    row = gsm8k_multiturn_row("test", 0, "Capital of France?", "unused")
    row["data_source"] = "nq"
    row["reward_model"]["ground_truth"] = {"target": ["Paris", "paris"]}
    path = tmp_path / "nq.parquet"
    pd.DataFrame([row]).to_parquet(path)
    (record,) = load_prompts(path)
    assert record.raw_ground_truth == {"target": ["Paris", "paris"]}
    assert record.ground_truth == '{"target": ["Paris", "paris"]}'


def test_flat_rows_load_with_empty_metadata():
    (record,) = records_from_rows([{"messages": [{"role": "user", "content": "hi"}], "ground_truth": 4}])
    assert (record.data_source, record.ability, record.reward_style, record.extra_info) == (None, None, None, {})
    assert (record.ground_truth, record.raw_ground_truth, record.interaction_kwargs) == ("4", 4, {})
    (flat,) = records_from_rows(
        [{"messages": [{"role": "user", "content": "hi"}], "data_source": "mine", "interaction_kwargs": {"name": "x"}}]
    )
    assert (flat.data_source, flat.interaction_kwargs) == ("mine", {"name": "x"})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"extra_info": [1, 2]}, "row 0: field 'extra_info' must be an object, got list"),
        ({"extra_info": {"interaction_kwargs": "query"}}, "row 0: field 'interaction_kwargs' must be an object"),
        ({"reward_model": "rule"}, "row 0: field 'reward_model' must be an object, got str"),
        ({"data_source": 7}, "row 0: field 'data_source' must be a string, got int"),
        ({"ability": ["math"]}, "row 0: field 'ability' must be a string, got list"),
    ],
)
def test_bad_verl_metadata_raises_value_errors_naming_row_and_field(change, needle):
    row = {**gsm8k_multiturn_row("train", 0, "q", "1"), **change}
    with pytest.raises(ValueError) as info:
        records_from_rows([row], "bad.parquet")
    assert needle in str(info.value) and "bad.parquet" in str(info.value), str(info.value)


# -- multimodal datasets (verl RLHFDataset's `images` column, e.g. geo3k) -----------------------------


def _png(rgb: tuple[int, int, int], size: tuple[int, int] = (56, 56), fmt: str = "PNG") -> bytes:
    """Encoded bytes of a two-colour picture (not flat, so a swapped image would show)."""
    import io

    from PIL import Image

    img = Image.new("RGB", size, rgb)
    img.paste((255 - rgb[0], 255 - rgb[1], 255 - rgb[2]), (0, 0, size[0] // 2, size[1] // 2))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


RED, GREEN = _png((220, 40, 40)), _png((40, 200, 60), (40, 30), "JPEG")
GEO3K_INSTRUCTION = "You FIRST think about the reasoning process as an internal monologue and then provide the answer."


def geo3k_row(index: int, content: str, images: list | None, answer: str = "3") -> dict:
    """One row as verl's examples/data_preprocess/geo3k.py writes it (images: HF's Image feature,
    `{"bytes", "path"}` each)."""
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": content}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "answer": answer, "question": content},
    }


def _decoded(url: str) -> bytes:
    import base64

    header, _, payload = url.partition(",")
    assert header.startswith("data:image/") and header.endswith(";base64")
    return base64.b64decode(payload)


def geo3k_rows(picture) -> list[dict]:
    return [
        geo3k_row(0, f"<image>Find x. {GEO3K_INSTRUCTION}", [{"bytes": RED, "path": None}]),
        geo3k_row(
            1, "Compare <image> and <image>.", [{"bytes": GREEN, "path": "green.jpg"}, {"bytes": None, "path": picture}]
        ),
        geo3k_row(2, "No picture here.", []),  # a text row in an image dataset: unchanged
    ]


def test_verl_multimodal_parquet_loads_images_as_content_parts(tmp_path):
    picture = tmp_path / "blue.png"
    picture.write_bytes(_png((30, 60, 230)))
    rows = geo3k_rows(str(picture))
    rows[1]["prompt"].insert(0, {"role": "system", "content": "Answer briefly."})
    path = tmp_path / "geo3k.parquet"
    table = verl_table(rows)
    assert table.schema.field("images").type == pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(table, path)
    first, second, third = load_prompts(path)

    (image, text) = first.messages[0]["content"]
    assert text == {"type": "text", "text": f"Find x. {GEO3K_INSTRUCTION}"} and image["type"] == "image"
    assert image["image"].startswith("data:image/png;base64,") and _decoded(image["image"]) == RED  # bytes kept
    assert first.ground_truth == "3" and first.data_source == "hiyouga/geometry3k" and "images" not in first.extra_info
    system, user = second.messages
    assert system == {"role": "system", "content": "Answer briefly."}  # no placeholder: a string still
    assert [p["type"] for p in user["content"]] == ["text", "image", "text", "image", "text"]
    assert [p["text"] for p in user["content"] if p["type"] == "text"] == ["Compare ", " and ", "."]
    jpeg, blue = (p["image"] for p in user["content"] if p["type"] == "image")
    assert jpeg.startswith("data:image/jpeg;base64,") and _decoded(jpeg) == GREEN  # bytes win over the path
    assert blue == str(picture)  # a path stays a path
    assert third.messages == [{"role": "user", "content": "No picture here."}]
    # pandas hands the same rows over as numpy arrays of dicts: the same records.
    assert records_from_rows(pd.read_parquet(path).to_dict("records"), str(path)) == [first, second, third]


def test_image_paths_data_urls_and_pil_images_as_entries(tmp_path, monkeypatch):
    """verl also takes a plain path per image; relative paths are made absolute at load (a worker may
    run elsewhere); an HF dataset's decoded rows hand over PIL images."""
    import base64
    import io
    import json

    from PIL import Image

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(RED)
    monkeypatch.chdir(tmp_path)
    url = "data:image/jpeg;base64," + base64.b64encode(GREEN).decode()
    row = geo3k_row(0, "<image><image><image>", ["pics/a.png", f"file://{tmp_path}/pics/a.png", url])
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (record,) = load_prompts(path)
    assert [p["image"] for p in record.messages[0]["content"]] == [str(tmp_path / "pics" / "a.png")] * 2 + [url]

    pil = Image.open(tmp_path / "pics" / "a.png")
    (decoded,) = records_from_rows([geo3k_row(0, "<image>what is it?", [pil])])
    png = _decoded(decoded.messages[0]["content"][0]["image"])
    assert Image.open(io.BytesIO(png)).tobytes() == pil.tobytes()  # stored as PNG: the same pixels


def test_flat_rows_may_carry_content_parts():
    parts = [{"type": "image", "image": "data:image/png;base64,AAAA"}, {"type": "text", "text": "what?"}]
    (record,) = records_from_rows([{"messages": [{"role": "user", "content": parts}]}])
    assert record.messages[0]["content"] == parts  # the loop reads the source at admission


async def test_a_verl_image_row_is_admitted_by_the_agent_loop(processor, tmp_path):
    """The loaded record through the real prompt admission (PENDING) of the agent loop with the tiny
    VLM's processor: ids equal the processor's rendering of the same chat, both images sent in order."""
    from dataclasses import replace

    from PIL import Image

    from streamrl.engines.fake import FakeEngine
    from streamrl.models.images import decode_image, image_sha256
    from streamrl.models.multimodal import render_image_chat
    from streamrl.rollout.agent_loop import SingleTurnAgentLoop
    from streamrl.rollout.images import ImageStore
    from streamrl.rollout.types import TrajectoryStatus
    from streamrl.streaming.prompts import make_group
    from tests.rollout.vlm_context import vlm_context

    blue = _png((30, 60, 230))
    (tmp_path / "blue.png").write_bytes(blue)
    pq.write_table(verl_table(geo3k_rows(str(tmp_path / "blue.png"))), tmp_path / "geo3k.parquet")
    record = replace(load_prompts(tmp_path / "geo3k.parquet")[1], agent_name="single_turn_agent")
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image", "image": decode_image(GREEN)},
                {"type": "text", "text": " and "},
                {"type": "image", "image": Image.open(tmp_path / "blue.png")},
                {"type": "text", "text": "."},
            ],
        }
    ]
    expected = render_image_chat(processor, chat)
    target = processor.tokenizer.encode(" two squares", add_special_tokens=False)
    engine = FakeEngine(script=lambda prompt_ids: target, image_token_id=processor.image_token_id)
    ctx = vlm_context(processor, engine, ImageStore(), prompt_length=256, response_length=64, max_tokens_per_turn=64)
    data = make_group(record, 0, 1, None)[0]
    traj = await SingleTurnAgentLoop(ctx).run(data)

    assert traj.status is TrajectoryStatus.FINISHED and traj.response_ids == target
    assert traj.prompt_ids == expected.input_ids
    assert traj.image_refs == [image_sha256(GREEN), image_sha256(blue)]
    assert traj.num_image_tokens == [processor.image_seq_len] * 2
    [(_, sent)] = engine.images_seen
    assert [i.data for i in sent] == [GREEN, blue]  # the dataset's own bytes, in placeholder order
    assert all("image" not in p for p in data.messages[0]["content"] if p["type"] == "image")  # refs only


@pytest.mark.parametrize(
    ("content", "images", "needle"),
    [
        (
            "<image><image>Find x.",
            [{"bytes": RED, "path": None}],
            "row 0: the string contents of 'prompt' have 2 '<image>' placeholder(s) "
            "but field 'images' holds 1 image(s)",
        ),
        ("Find x.", [{"bytes": RED, "path": None}], "have 0 '<image>' placeholder(s) but field 'images' holds 1"),
        ([{"type": "text", "text": "Find x."}], [{"bytes": RED, "path": None}], "have 0 '<image>' placeholder(s)"),
        (
            None,
            [{"bytes": RED, "path": None}],
            "row 0: prompt[0] has no string 'content' (nor a list of text / image parts)",
        ),
        ({"text": "<image>"}, [{"bytes": RED, "path": None}], "row 0: prompt[0] has no string 'content'"),
        ("<image>", [{"bytes": b"GIF89a broken", "path": None}], "row 0: images[0]: not an image (13 bytes)"),
        (
            "<image>",
            [{"bytes": None, "path": "/no/such/picture.png"}],
            "row 0: images[0]: image file '/no/such/picture.png' does not exist",
        ),
        ("<image>", [{"bytes": None, "path": None}], "row 0: images[0]: an image entry needs 'bytes' or a 'path'"),
        ("<image>", ["https://example.com/a.png"], "row 0: images[0]: image 'https://example.com/a.png' is a URL"),
        ("<image>", ["data:image/png,raw"], "row 0: images[0]: image data URL must be base64"),
        ("<image>", [7], "row 0: images[0]: unsupported image entry int"),
        ("<image>", {"bytes": RED}, "row 0: field 'images' must be a list of images, got dict"),
        (
            "<image><video>",
            [{"bytes": RED, "path": None}],
            "row 0: a message has a '<video>' placeholder; video is not supported",
        ),
    ],
)
def test_bad_verl_image_rows_raise_value_errors_naming_the_row(content, images, needle):
    with pytest.raises(ValueError) as info:
        records_from_rows([geo3k_row(0, content, images)], "bad.parquet")
    assert needle in str(info.value) and "bad.parquet row 0" in str(info.value), str(info.value)


def test_video_rows_are_refused_not_dropped():
    row = {**geo3k_row(0, "<video>What happens?", None), "videos": [{"video": "clip.mp4"}]}
    with pytest.raises(
        ValueError, match=r"bad.parquet row 0: field 'videos' holds 1 video\(s\); video is not supported"
    ):
        records_from_rows([row], "bad.parquet")
    assert records_from_rows([{**geo3k_row(0, "text", None), "videos": []}])[0].messages[0]["content"] == "text"


# -- rewards ------------------------------------------------------------------------------------------

SEEN: list[dict] = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style scorer: strict `#### answer` match; a dict result for the "detailed" source."""
    SEEN.append(
        {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
        }
    )
    answer = solution_str.rsplit("####", 1)[-1].strip() if "####" in solution_str else None
    score = 1.0 if answer == ground_truth else 0.0
    if data_source == "detailed":
        return {"score": score, "acc": answer == ground_truth, "pred": answer}
    return score


def compute_score_without_extra_info(data_source, solution_str, ground_truth):
    return float(solution_str.endswith(ground_truth))


def compute_score_with_kwargs(solution_str, ground_truth, **kwargs):
    SEEN.append(kwargs)
    return np.float64(0.25)


async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def our_style(inp: RewardInput) -> float:
    return 0.5


def reward_input(record: PromptRecord, *assistant: str) -> RewardInput:
    """What the agent loop should build at trajectory end from the trajectory's record."""
    return RewardInput(
        response_text="\n".join(assistant),
        final_answer_text=assistant[-1],
        ground_truth=record.ground_truth,
        num_turns=len(assistant),
        data_source=record.data_source,
        raw_ground_truth=record.raw_ground_truth,
        extra_info=record.extra_info,
    )


def test_verl_compute_score_is_detected_by_signature_and_adapted(tmp_path):
    SEEN.clear()
    path = tmp_path / "train.parquet"
    pq.write_table(verl_table(verl_rows()), path)
    record = load_prompts(path)[0]
    for spec in (f"{HERE}:compute_score", f"verl:{HERE}:compute_score", f"verl:{HERE}.compute_score"):
        fn = get_reward_fn(spec)
        assert fn.__name__ == "verl_compute_score"
        assert fn(reward_input(record, "I will call the tool.", "48 + 24 = 72\n#### 72")) == 1.0
        assert fn(reward_input(record, "#### 71")) == 0.0
    assert SEEN[0] == {
        "data_source": "openai/gsm8k",
        "solution_str": "I will call the tool.\n48 + 24 = 72\n#### 72",  # the assistant text of all turns
        "ground_truth": "72",
        "extra_info": record.extra_info,
    }
    SEEN[0]["extra_info"]["index"] = 99  # a scorer writing into extra_info does not touch the record
    assert record.extra_info["index"] == 0


def test_verl_dict_results_raw_ground_truth_and_partial_signatures():
    SEEN.clear()
    inp = RewardInput(response_text="#### 4", final_answer_text="#### 4", ground_truth="4", data_source="detailed")
    assert verl_reward_fn(compute_score)(inp) == 1.0  # {"score": 1.0, "acc": True, "pred": "4"}
    assert verl_score({"score": 1, "acc": True, "pred": "4", "n": np.int64(3)}) == VerlScore(
        score=1.0, extras={"acc": 1.0, "n": 3.0}
    )
    raw = RewardInput(
        response_text="x",
        final_answer_text="x",
        ground_truth='{"target": ["x"]}',
        raw_ground_truth={"target": ["x"]},
        extra_info={"k": 1},
    )
    verl_reward_fn(compute_score)(raw)
    assert SEEN[-1]["ground_truth"] == {"target": ["x"]}  # the value as stored, like verl passes it
    assert get_reward_fn(f"{HERE}:compute_score_without_extra_info")(inp) == 1.0
    assert get_reward_fn(f"{HERE}:compute_score_with_kwargs")(raw) == 0.25
    assert SEEN[-1] == {"data_source": None, "extra_info": {"k": 1}}


def test_reward_functions_of_our_signature_are_returned_as_is():
    assert get_reward_fn(f"{HERE}:our_style") is our_style
    assert get_reward_fn("streamrl.rollout.rewards:math_answer") is math_answer
    assert not is_verl_compute_score(our_style) and is_verl_compute_score(compute_score)
    assert not is_verl_compute_score(len)


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        (None, "compute_score returned NoneType None"),
        ("1.0", "compute_score returned str '1.0'"),
        ({"acc": 1.0}, "without a 'score' entry (keys: ['acc'])"),
        ({"score": "high"}, "compute_score returned str 'high'"),
    ],
)
def test_bad_verl_results_raise_value_errors(result, needle):
    with pytest.raises(ValueError) as info:
        verl_score(result)
    assert needle in str(info.value), str(info.value)
    assert verl_score(True) == VerlScore(score=1.0) and verl_score(np.float32(0.5)).score == 0.5


def test_bad_verl_specs_raise_value_errors():
    with pytest.raises(ValueError, match=r"our_style does not take verl's compute_score arguments"):
        get_reward_fn(f"verl:{HERE}:our_style")
    with pytest.raises(ValueError, match="async_compute_score is async"):
        get_reward_fn(f"{HERE}:async_compute_score")
    with pytest.raises(ValueError, match="unknown reward function 'verl:nope'"):
        get_reward_fn("verl:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg'"):
        get_reward_fn("verl:no_such_pkg:compute_score")


async def test_a_verl_row_reaches_the_verl_scorer_through_the_agent_loop(tmp_path, tiny_tokenizer):
    """Row metadata travels record -> AgentData (make_group, and so every snapshot and resume) ->
    RewardInput at trajectory end: the scorer sees the row's data_source, raw ground truth and extra_info."""
    from dataclasses import replace

    from streamrl.engines.fake import FakeEngine
    from streamrl.rollout.agent_loop import ToolAgentLoop
    from streamrl.rollout.types import AgentData
    from streamrl.streaming.prompts import make_group
    from tests.rollout.test_agent_loop import make_ctx, turn_script

    SEEN.clear()
    path = tmp_path / "train.parquet"
    pq.write_table(verl_table(verl_rows()), path)
    record = replace(load_prompts(path)[0], agent_name="tool_agent")
    data = make_group(record, 0, 1, None)[0]
    data = AgentData.model_validate_json(data.model_dump_json())  # as a parked snapshot reloads it
    script, _ = turn_script(tiny_tokenizer, [f"48 + 24 = 72\n#### {record.raw_ground_truth}"])
    ctx = make_ctx(tiny_tokenizer, FakeEngine(script=script))
    ctx.reward_fn = get_reward_fn(f"{HERE}:compute_score")
    traj = await ToolAgentLoop(ctx).run(data)
    assert traj.reward == 1.0
    assert SEEN == [
        {
            "data_source": "openai/gsm8k",
            "solution_str": "48 + 24 = 72\n#### 72",
            "ground_truth": "72",
            "extra_info": record.extra_info,
        }
    ]
