"""The commands README.md and docs/ show are the commands that work: every `streamrl ...` line of a
code block parses, every `make X` is a Makefile target, every `python -m X` of ours exists, and
`buffer stats`, `buffer export --parquet`, `report` and `train --dry-run` run on a small buffer / run
directory built here (no Ray, no engine)."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from streamrl.streaming.cli import main, parse_argv

REPO = Path(__file__).resolve().parents[2]
# What the README's optional groups stand for when filled in (others are used as written).
FILL = {"key=value ...": "trainer.total_steps=2 learner.lr=1e-5", "--num-prompts N": "--num-prompts 4"}


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_blocks(path: Path) -> list[str]:
    """The lines of every fenced code block of a markdown file."""
    parts = path.read_text().split("```")
    return [line for block in parts[1::2] for line in block.splitlines()]


def readme_cli_lines() -> list[str]:
    """The `streamrl ...` lines of the code block under README's `## CLI`, comments stripped."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## CLI", 1)[1]
    block = section.split("```", 2)[1]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip().startswith("streamrl ")]


def doc_cli_lines() -> list[str]:
    """Every `streamrl ...` line of a code block in the README and in docs/, comments stripped."""
    lines = {
        line.split("#", 1)[0].strip()
        for path in DOCS
        for line in code_blocks(path)
        if line.strip().startswith("streamrl ")
    }
    return sorted(lines)


def doc_make_targets() -> set[str]:
    """`make X` named in code (blocks and inline spans) in the README and docs/."""
    found = set()
    for path in DOCS:
        text = path.read_text()
        code = " ".join(code_blocks(path)) + " " + " ".join(re.findall(r"`([^`\n]+)`", text))
        found |= set(re.findall(r"\bmake ([a-z][a-z-]*)", code))
    return found


def doc_python_modules() -> set[str]:
    """`python -m X` named in the README and docs/ (X a module of this repository)."""
    return {m for path in DOCS for m in re.findall(r"python -m ((?:bench|streamrl)[\w.]*)", path.read_text())}


def variants(line: str) -> list[str]:
    """Each `[optional ...]` group left out and filled in, in every combination."""
    groups = re.findall(r"\[([^\]]+)\]", line)
    out = []
    for keep in itertools.product([False, True], repeat=len(groups)):
        text = line
        for group, k in zip(groups, keep):
            text = text.replace(f"[{group}]", FILL.get(group, group) if k else "", 1)
        out.append(" ".join(text.split()))
    return out


@pytest.fixture(autouse=True)
def _restore_logging():
    """`main` and the logs helpers configure the root and `ray` loggers; put them back for the other tests."""
    import logging

    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    saved = list(root.handlers), root.level, list(ray_logger.handlers), ray_logger.propagate
    yield
    root.handlers[:], ray_logger.handlers[:] = saved[0], saved[2]
    root.setLevel(saved[1])
    ray_logger.propagate = saved[3]


def test_documented_make_targets_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    named = doc_make_targets()
    assert {"run", "test", "lint", "bench", "chaos"} <= named
    assert named <= targets, sorted(named - targets)


def test_documented_python_modules_exist():
    import importlib.util

    modules = doc_python_modules()
    assert "bench.fresh_run" in modules
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert missing == []


def test_readme_cli_block_is_found():
    lines = readme_cli_lines()
    commands = {tuple(shlex.split(line)[1:3]) for line in lines}
    assert len(lines) >= 6
    assert ("buffer", "stats") in commands and ("buffer", "export") in commands
    assert any(line.startswith("streamrl train --resume") for line in lines)


@pytest.mark.parametrize("line", doc_cli_lines())
def test_every_documented_command_parses(line):
    for text in variants(line):
        argv = shlex.split(text)[1:]
        args = parse_argv(argv)
        assert callable(args.func), text
        assert args.command == argv[0], text
        if argv[0] == "buffer":
            assert args.buffer_command == argv[1], text


def _buffer_dir(root: Path) -> Path:
    from streamrl.buffer.config import BufferConfig
    from streamrl.buffer.store import ReplayBuffer
    from tests.buffer.helpers import make_group

    buf = ReplayBuffer(BufferConfig(root_dir=str(root), batch_size=2, group_size=2))
    buf.append(make_group("a", 2, rewards=[0.0, 1.0]) + make_group("b", 2, version=1))
    buf.sample(served_version=1, learner_step=1)
    buf.close()
    return root


def test_buffer_stats_and_export_as_the_readme_shows(tmp_path, capsys):
    buffer_dir = _buffer_dir(tmp_path / "buffer")
    assert main(["buffer", "stats", str(buffer_dir)]) == 0
    out = capsys.readouterr().out
    assert "rows logged: 4, trajectories: 4, groups: 2" in out and "consumed: 2 trajectories" in out
    parquet = tmp_path / "out" / "rows.parquet"
    assert main(["buffer", "export", str(buffer_dir), "--parquet", str(parquet)]) == 0
    assert f"wrote 4 rows to {parquet}" in capsys.readouterr().out
    assert pq.read_table(parquet).num_rows == 4


def test_staleness_as_the_readme_shows(tmp_path, capsys):
    _buffer_dir(tmp_path / "buffer")
    assert main(["staleness", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 finished trajectories, 2 trained (2 uses)" in out and "staleness.html" in out
    assert (tmp_path / "staleness.json").exists() and (tmp_path / "staleness.html").exists()


def test_buffer_stats_of_a_missing_directory_is_one_error_line(tmp_path, capsys):
    assert main(["buffer", "stats", str(tmp_path / "nope")]) == 2
    assert "streamrl: error:" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_report_as_the_readme_shows(tmp_path, capsys, tiny_model_path, tiny_tokenizer):
    from tests.observability.test_report import _write_run

    _write_run(tmp_path, tiny_tokenizer, tiny_model_path)
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.html").stat().st_size > 0
    assert "report written to" in capsys.readouterr().out


@pytest.mark.parametrize("config", ["configs/tiny.toml", "configs/default.toml"])
def test_train_dry_run_prints_config_and_estimate_and_starts_nothing(config, tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(REPO)
    started = []  # the suite's session cluster may already be up: check that the dry run starts none
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(1))
    assert main(["train", "--dry-run", "--config", config, f"trainer.run_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("resolved config:\n{")
    assert f'"run_root": "{tmp_path}"' in out
    assert "memory estimate" in out and "engine KV cache" in out and "total (host)" in out
    assert started == []
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_train_dry_run_of_a_bad_override_is_one_error_line(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "--dry-run", "--config", "configs/tiny.toml", "rollout.num_engines=0"]) == 2
    assert "rollout.num_engines" in capsys.readouterr().err


# ---- what `streamrl train` shows, and where the rest goes (observability/logs.py) -----------------


def test_console_shows_our_lines_and_others_errors_while_driver_log_keeps_everything(tmp_path, capsys):
    import logging

    from streamrl.observability.logs import FILE_ONLY, PROGRESS_EXTRA, attach_run_log, setup_console

    setup_console(verbose=False)
    path = attach_run_log(tmp_path)
    logging.getLogger("streamrl.streaming.train").info("ours")
    # a library logger nobody configured (vLLM, once imported by an earlier test, stops propagating)
    logging.getLogger("otherlib.engine").info("vllm chatter")
    logging.getLogger("ray").info("ray chatter")
    logging.getLogger("otherlib.engine").error("vllm failure")
    logging.getLogger("streamrl.streaming.train").error("traceback for the file", extra=FILE_ONLY)
    logging.getLogger("streamrl.observability.metrics").info("step 1/4", extra=PROGRESS_EXTRA)  # no bar off a terminal
    for handler in logging.getLogger().handlers:
        handler.flush()
    console = capsys.readouterr().err
    assert "ours" in console and "vllm failure" in console and "step 1/4" in console
    assert "chatter" not in console and "traceback for the file" not in console
    text = path.read_text()
    for line in ("ours", "vllm chatter", "ray chatter", "vllm failure", "traceback for the file", "step 1/4"):
        assert line in text
    for handler in [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]:
        handler.close()


def test_ray_options_send_actor_output_to_run_logs_unless_verbose(tmp_path):
    from streamrl.core.trace import RUN_DIR_ENV
    from streamrl.observability.logs import LOG_DIR_ENV, WORKER_SETUP_HOOK, ray_init_options, setup_console

    run = {RUN_DIR_ENV: str(tmp_path.resolve())}  # every actor finds its run (the lifecycle trace)
    setup_console(verbose=False)
    quiet = ray_init_options(tmp_path, {"A": "1"})
    assert quiet["log_to_driver"] is False
    assert quiet["runtime_env"] == {
        "env_vars": {"A": "1", **run, LOG_DIR_ENV: str((tmp_path / "logs").resolve())},
        "worker_process_setup_hook": WORKER_SETUP_HOOK,
    }
    setup_console(verbose=True)
    verbose = ray_init_options(tmp_path, {"A": "1"})
    assert verbose == {"log_to_driver": True, "runtime_env": {"env_vars": {"A": "1", **run}}}
    setup_console(verbose=False)


WORKER = """
import logging, os, sys
from streamrl.observability.logs import setup_worker_logging
setup_worker_logging()
print(":actor_name:EngineActor")
print("from print")
os.write(2, b"from fd 2\\n")
logging.getLogger("streamrl.rollout.worker").info("from logging")
print(os.getpid())
"""


def test_worker_hook_redirects_a_process_output_and_logs_are_named_after_their_actor(tmp_path):
    import os
    import subprocess
    import sys

    from streamrl.observability.logs import LOG_DIR_ENV, name_worker_logs

    logs = tmp_path / "logs"
    env = {**os.environ, LOG_DIR_ENV: str(logs)}
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout == "" and done.stderr == ""  # all of it went to the file
    (logs / "worker-1.log").touch()  # an idle worker process: nothing written
    pid = (logs / next(p.name for p in logs.glob("worker-*.log") if p.stat().st_size)).read_text().split()[-1]
    named = name_worker_logs(tmp_path)
    assert [p.name for p in named] == [f"EngineActor-{pid}.log"]
    text = named[0].read_text()
    assert "from print" in text and "from fd 2" in text and "INFO streamrl.rollout.worker: from logging" in text
    assert not (logs / "worker-1.log").exists()


def test_run_summary_says_where_everything_is(tmp_path):
    from streamrl.observability.logs import run_summary

    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    done = run_summary(tmp_path, learner_step=4, total_steps=4, elapsed_s=125, report=tmp_path / "report.html")
    assert done.splitlines()[0] == "run finished at learner step 4/4 after 2:05"
    assert f"report       {tmp_path / 'report.html'}" in done and "(latest step_000002)" in done
    assert f"logs         {tmp_path / 'logs'}" in done and "--resume" not in done
    stopped = run_summary(tmp_path, learner_step=2, total_steps=4, elapsed_s=60, report=None)
    assert stopped.startswith("run stopped at learner step 2/4") and f"streamrl train --resume {tmp_path}" in stopped


def test_scale_writes_a_request_the_driver_reads(tmp_path, capsys):
    from streamrl.streaming.elastic import read_scale_request

    assert main(["scale", str(tmp_path), "--engines", "3"]) == 2  # not a run directory
    (tmp_path / "run_info.json").write_text("{}")
    assert main(["scale", str(tmp_path)]) == 2  # nothing asked
    assert main(["scale", str(tmp_path), "--engines", "0"]) == 2
    assert main(["scale", str(tmp_path), "--engines", "3", "--preempt", "engine-1"]) == 0
    first = read_scale_request(tmp_path)
    assert first is not None and first.engines == 3 and first.preempt == ("engine-1",)
    assert main(["scale", str(tmp_path), "--preempt", "engine-0"]) == 0
    second = read_scale_request(tmp_path)
    assert second is not None and second.request_id != first.request_id and second.engines is None
    assert "scale request" in capsys.readouterr().out
    (tmp_path / "scale_request.json").write_text('{"engines": 2}')  # hand-written, no request id
    assert read_scale_request(tmp_path) is None
