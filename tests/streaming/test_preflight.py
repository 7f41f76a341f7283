"""What `streamrl train` checks and prepares before it starts, and how it explains a part that dies:
the memory estimate (plausible totals for the shipped configs, a refusal
naming the knob), `explain_failure` on constructed Ray exceptions, and the model-preparation child."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from ray.exceptions import OutOfMemoryError, RayActorError

from streamrl.models.dims import model_dims
from streamrl.streaming import preflight
from streamrl.streaming.config import load_config
from streamrl.streaming.errors import StreamRLError, exception_chain, explain_failure
from streamrl.streaming.preflight import GiB, estimate_parts

REPO = Path(__file__).resolve().parents[2]
# Ray 2.55+ memory-monitor text (src/ray/raylet/node_manager.cc), as an actor call surfaces it.
OOM_TEXT = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1, "
    "ID: 3a4b) was 22.31GB used / 23.49GB limit (0.950). (job ID=01000000, lease ID=ab, "
    "task name=LearnerActor.train_step, required resources={}, pid=4242, actual memory used=9.87GB, worker ID=5c9a)"
)


def _cfg(config: str, *overrides: str):
    return load_config(REPO / config, list(overrides))


def _host_gib(parts) -> float:
    return sum(p.bytes for p in parts if not p.on_gpu) / GiB


@pytest.fixture
def machine_24g(monkeypatch):
    """A 24 GiB machine with 16 GiB free, whatever this one has."""
    monkeypatch.setattr(
        preflight, "available_memory", lambda: (int(22.8 * GiB), 16 * GiB, "this machine (24.0 GiB RAM)", None)
    )


def test_estimates_for_the_shipped_configs_are_plausible():
    tiny = estimate_parts(_cfg("configs/tiny.toml"), model_dims("tiny"))
    default_cfg = _cfg("configs/default.toml")
    default = estimate_parts(default_cfg, model_dims("smollm2"))
    by_name = {p.name: p.bytes for p in default}
    assert by_name["learner weights+grads+AdamW"] == 16 * 134_515_008
    assert by_name["engine KV cache (×1)"] == 2 * GiB  # rollout.engine.kv_cache_space_gb = 2
    assert by_name["learner logits chunk"] == default_cfg.learner.logits_chunk_tokens * 49152 * 4 * 3
    # 640 tokens of SmolLM2, fp32, checkpointed (the default): measured step peak minus the resident set
    # after a step ≈ 0.37-0.45 GiB (bench/results/learner_peak.json); without checkpointing ≈ 1.1-1.4 GB
    assert 0.3 * GiB < by_name["learner activations"] < 1 * GiB
    no_gc = {
        p.name: p.bytes
        for p in estimate_parts(
            _cfg("configs/default.toml", "learner.gradient_checkpointing=false"), model_dims("smollm2")
        )
    }
    assert 0.7 * GiB < no_gc["learner activations"] < 2 * GiB
    assert 4 < _host_gib(tiny) < 8  # mostly fixed process costs: the model is 0.1M params
    assert 9 < _host_gib(default) < 14  # measured node peak of `make run`: 11.1 GB (README, Measured)
    assert not any(p.on_gpu for p in tiny + default)  # device "auto" on this CPU-only torch


def test_knobs_move_the_estimate():
    plain = ("learner.gradient_checkpointing=false", "learner.logits_chunk_tokens=512")  # the plain learner
    base = _host_gib(estimate_parts(_cfg("configs/default.toml", *plain), model_dims("smollm2")))
    for override in (
        "learner.gradient_checkpointing=true",
        "learner.micro_batch_tokens=320",
        "learner.logits_chunk_tokens=256",
    ):
        assert (
            _host_gib(estimate_parts(_cfg("configs/default.toml", *plain, override), model_dims("smollm2"))) < base
        ), override
    more = estimate_parts(_cfg("configs/default.toml", *plain, "rollout.num_engines=2"), model_dims("smollm2"))
    assert _host_gib(more) == pytest.approx(base + 2 + 134_515_008 * 4 / GiB + 1.7, abs=0.01)


def test_cuda_parts_leave_host_ram():
    parts = estimate_parts(
        _cfg("configs/default.toml", "rollout.engine.device=cuda", "rollout.engine.num_gpus=1", "learner.device=cuda"),
        model_dims("smollm2"),
    )
    on_gpu = {p.name for p in parts if p.on_gpu}
    assert {
        "learner weights+grads+AdamW",
        "learner activations",
        "engine weights (×1)",
        "engine KV cache (×1)",
    } <= on_gpu
    assert "engine process (×1)" not in on_gpu and "driver" not in on_gpu


def test_check_refuses_a_kv_cache_that_cannot_fit(machine_24g):
    with pytest.raises(ValueError) as err:
        preflight.check(_cfg("configs/tiny.toml", "rollout.engine.kv_cache_space_gb=100"))
    message = str(err.value)
    assert "rollout.engine.kv_cache_space_gb" in message and "22.8 GiB" in message
    assert "\n" not in message and message.count(". ") == 0  # one sentence
    assert preflight.check(_cfg("configs/default.toml")).fits


def test_check_warns_when_other_processes_leave_too_little(monkeypatch, caplog):
    monkeypatch.setattr(preflight, "available_memory", lambda: (int(22.8 * GiB), 2 * GiB, "this machine", None))
    with caplog.at_level("WARNING", logger="streamrl.streaming.preflight"):
        assert preflight.check(_cfg("configs/tiny.toml")).tight
    assert "may be killed for memory" in caplog.text


def test_available_memory_of_this_machine(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    limit, free, source, gpus = preflight.available_memory()
    assert 0 < free and 0 < limit and gpus is None and source.startswith("this machine")


# ---- explain_failure -------------------------------------------------------------------------


def _wrapped(inner: BaseException) -> BaseException:
    """What streaming/driver.py raises: `RuntimeError("learner loop failed") from <the Ray error>`."""
    try:
        try:
            raise inner
        except BaseException as exc:
            raise RuntimeError("learner loop failed") from exc
    except RuntimeError as outer:
        return outer


def test_explain_failure_names_the_part_its_peak_and_the_resume_command(tmp_path):
    run_dir = tmp_path / "runs" / "default-1"
    text = explain_failure(_wrapped(OutOfMemoryError(OOM_TEXT)), run_dir)
    assert text is not None and "\n" not in text
    assert text.startswith(
        "the learner (LearnerActor, pid 4242, peak 9.87GB) was killed for lack of memory "
        "with the node at 22.31GB of 23.49GB; shrink it with learner.micro_batch_tokens"
    )
    assert text.endswith(f"continue the run with: streamrl train --resume {run_dir}")


def test_explain_failure_reads_an_actor_death_for_memory(tmp_path):
    died = RayActorError(
        actor_id="ab",
        error_msg=(
            "The actor died unexpectedly before finishing this task.\n"
            "\tclass_name: EngineActor\n\tactor_id: ab\n\tpid: 77\n"
            "The actor is dead because its worker process has died. "
            "Worker exit type: NODE_OUT_OF_MEMORY Worker exit detail: "
            + OOM_TEXT.replace("LearnerActor.train_step", "EngineActor.generate").replace("pid=4242", "pid=77")
        ),
    )
    loop_error = RuntimeError("admission loop failed")
    loop_error.__cause__ = ExceptionGroup("tasks", [ValueError("unrelated"), died])
    text = explain_failure(loop_error, tmp_path)
    assert text is not None and text.startswith("the inference engine (EngineActor, pid 77, peak 9.87GB) was killed")
    assert "rollout.engine.kv_cache_space_gb" in text and f"--resume {tmp_path}" in text


def test_explain_failure_names_every_worker_one_kill_took(tmp_path):
    """Ray >= 2.55 kills several workers at once and lists them all (text from a real run here)."""
    text = (
        "2 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: ae32) "
        "was 6.42GB used / 23.54GB limit (0.272555)\nSelected to kill: (Task: job ID=01000000, lease ID=0100, "
        "task name=BufferActor.__init__, required resources={}, pid=27064, actual memory used=0.04GB, worker ID=d0fa)\n"
        "Selected to kill: (Task: job ID=01000000, lease ID=0200, task name=EngineActor.__init__, "
        "required resources={CPU: 1}, pid=27063, actual memory used=2.10GB, worker ID=6972)\n"
    )
    message = explain_failure(_wrapped(OutOfMemoryError(text)), tmp_path)
    assert message is not None and message.startswith(
        "the inference engine (EngineActor, pid 27063, peak 2.10GB) and the replay buffer (BufferActor, pid 27064, "
        "peak 0.04GB) were killed for lack of memory with the node at 6.42GB of 23.54GB; shrink it with "
        "rollout.engine.kv_cache_space_gb, rollout.num_engines, "
    )


def test_explain_failure_leaves_other_failures_alone(tmp_path):
    preempted = RayActorError(
        actor_id="cd", error_msg="The actor died unexpectedly: SIGKILL\n\tclass_name: RolloutWorkerActor"
    )
    assert explain_failure(_wrapped(preempted), tmp_path) is None
    assert explain_failure(_wrapped(ValueError("out of memory?")), tmp_path) is None  # not a Ray kill
    unknown = explain_failure(OutOfMemoryError("Task was killed due to the node running low on memory."), tmp_path)
    assert unknown is not None and unknown.startswith("a part of the run was killed for lack of memory;")


def test_exception_chain_terminates_on_cycles():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert [str(e) for e in exception_chain(a)] == ["a", "b"]


# ---- prepare_model -----------------------------------------------------------------------------


def test_prepare_model_returns_a_ready_folder_without_a_child(tiny_model_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("no child process for a ready folder"))
    from streamrl.streaming.sft import prepare_model

    cfg = _cfg("configs/tiny.toml", f"model={tiny_model_path}")
    assert prepare_model(cfg) == str(tiny_model_path)
    # a built-in already in the cache is a ready folder too (the child costs 3-5 s of imports)
    assert prepare_model(_cfg("configs/tiny.toml")) == str(tiny_model_path)


@pytest.mark.timeout(120)
def test_prepare_model_builds_in_a_child_and_reports_its_failure(tmp_path, monkeypatch, caplog):
    from streamrl.streaming.sft import prepare_model

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path / "cache"))  # an empty cache: "tiny" must be built
    with caplog.at_level(logging.INFO, logger="streamrl.streaming.sft"):
        built = prepare_model(_cfg("configs/tiny.toml"), log_file=tmp_path / "ok.log")
    assert built == str(tmp_path / "cache/models/tiny-v1") and (Path(built) / "model.safetensors").exists()
    assert "model ready" in (tmp_path / "ok.log").read_text()  # resolved in the child
    # the child's progress reaches this process's console while its output goes to the log
    assert "model 'tiny': converting or building it" in caplog.text
    cfg = _cfg("configs/tiny.toml", "sft.enabled=true", f"model={tmp_path / 'missing'}")
    log = tmp_path / "logs" / "prepare_model.log"
    with pytest.raises(StreamRLError) as err:
        prepare_model(cfg, log_file=log)
    assert "exit code 1" in str(err.value) and "neither a built-in" in str(err.value) and str(log) in str(err.value)


def test_progress_lines_are_followed_as_the_log_grows(tmp_path):
    from streamrl.streaming.sft import PROGRESS, ProgressFollower

    log = tmp_path / "child.log"
    log.write_bytes(b"old run [progress] not ours\n")
    follow = ProgressFollower(log, log.stat().st_size)
    with open(log, "ab") as f:
        f.write(f"noise\n12:00 INFO x: {PROGRESS} sft step 1/8 · loss 1.0\n12:01 INFO x: {PROGRESS} sft st".encode())
    assert follow.new_lines() == ["sft step 1/8 · loss 1.0"]  # the unfinished line waits
    with open(log, "ab") as f:
        f.write(b"ep 2/8\n")
    assert follow.new_lines() == ["sft step 2/8"]
    assert follow.new_lines() == []


def test_explain_failure_for_every_engine_gone(tmp_path):
    from streamrl.engines.base import NoHealthyEngineError

    run_dir = tmp_path / "runs" / "r"
    text = explain_failure(
        _wrapped(NoHealthyEngineError("no inference engine is alive: engine-0: ActorDiedError")), run_dir
    )
    assert text == (
        f"the run stopped because no inference engine is left (no inference engine is alive: engine-0: "
        f"ActorDiedError); see {run_dir}/logs, then continue the run with: streamrl train --resume {run_dir}"
    )
    assert explain_failure(_wrapped(ValueError("something else")), run_dir) is None


def test_prompts_that_cannot_fit_stop_the_run_before_it_starts(tiny_model_path, caplog):
    """Found running the code-interpreter demo with the calculator's prompt_length: every trajectory
    failed ("prompt of 620 tokens exceeds agent.prompt_length=512") and the run cycled through epoch
    after epoch of failed groups. The prepare step now measures the prompts as the agent loop renders
    them (chat template + tool schemas)."""
    from streamrl.streaming.sft import check_prompt_lengths

    base = [
        "rollout.agent.tool_config=configs/tools/code_interpreter.yaml",
        "data.difficulty=easy",
        "rollout.engine.max_model_len=2048",
    ]
    lengths = check_prompt_lengths(_cfg("configs/tiny.toml", *base, "rollout.agent.prompt_length=896"), tiny_model_path)
    assert len(lengths) == 32 and max(lengths) <= 896 and min(lengths) > 512
    with pytest.raises(ValueError, match=r"every prompt checked \(32\) is longer than rollout.agent.prompt_length=512"):
        check_prompt_lengths(_cfg("configs/tiny.toml", *base, "rollout.agent.prompt_length=512"), tiny_model_path)
    between = sorted(lengths)[len(lengths) // 2]
    check_prompt_lengths(_cfg("configs/tiny.toml", *base, f"rollout.agent.prompt_length={between}"), tiny_model_path)
    assert "of the first 32 prompts are longer than" in caplog.text


def test_vlm_param_count_covers_the_vision_tower():
    """Found running configs/vlm_tiny.toml: preflight refused "tiny-vlm" (not a built-in there) and an
    Idefics3 folder has its text dims under `text_config`. The estimate counts the text model plus the
    vision tower and connector, equal to the stored weights for the built-in name and for the folder."""
    import safetensors

    from streamrl.models import resolve_model

    folder = resolve_model("tiny-vlm")
    with safetensors.safe_open(str(folder / "model.safetensors"), "np") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    stored = sum(math.prod(s) for s in shapes.values())
    vision = sum(math.prod(s) for k, s in shapes.items() if "vision" in k or "connector" in k)
    dims = model_dims(str(folder))
    assert (dims.num_params, dims.vision_params) == (stored, vision)
    assert model_dims("tiny-vlm").num_params == stored
    parts = {p.name: p.bytes for p in estimate_parts(_cfg("configs/vlm_tiny.toml"), model_dims("tiny-vlm"))}
    assert parts["learner weights+grads+AdamW"] == 16 * stored


def test_image_prompts_are_measured_with_their_placeholder_runs():
    """Each image is its whole placeholder run in the prompt the engine and the learner see (the HF
    processor's expansion), not the one `<image>` token the chat template renders."""
    from transformers import AutoProcessor

    from streamrl.models import resolve_model
    from streamrl.models.images import decode_image, load_image_source
    from streamrl.rollout.data import load_records
    from streamrl.streaming.sft import check_prompt_lengths

    folder = resolve_model("tiny-vlm")
    processor = AutoProcessor.from_pretrained(folder)
    record = load_records("dots", 1, 0)[0]
    parts = [{"type": "image"} if p["type"] == "image" else p for p in record.messages[0]["content"]]
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    image = decode_image(load_image_source(record.messages[0]["content"][0]["image"]))
    expected = len(processor(text=[text], images=[[image]], add_special_tokens=False)["input_ids"][0])
    lengths = check_prompt_lengths(
        _cfg("configs/vlm_tiny.toml", f"rollout.agent.prompt_length={expected}"), folder, sample=4
    )
    assert lengths == [expected] * 4
    with pytest.raises(ValueError, match=r"every prompt checked \(4\) is longer"):
        check_prompt_lengths(
            _cfg("configs/vlm_tiny.toml", f"rollout.agent.prompt_length={expected - 1}"), folder, sample=4
        )
