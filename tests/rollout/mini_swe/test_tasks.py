"""The coding tasks and the harness's config: every shipped task is broken as given and fixed by its
solution (scored by its hidden tests in the sandbox), task files are checked, group ids name tasks, and
the `[rollout.agent.mini_swe]` section is wired into a run's config as verifiers' is.

No harness venv and no model: the sandbox and the scoring only (a few seconds per task)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.mini_swe.config import CommandSandbox, PreparedMiniSwe
from streamrl.rollout.mini_swe.prepare import PACKAGE, episode_command, resolve_config
from streamrl.rollout.mini_swe.shell import RepoShell
from streamrl.rollout.mini_swe.tasks import load_task, load_tasks, prompt_rows, task_id_of, write_files
from streamrl.streaming.config import load_config

REPO = Path(__file__).resolve().parents[3]
TASKS = load_tasks(REPO / "workloads" / "swe_tasks")


def test_the_shipped_tasks_are_small_and_split():
    assert len(TASKS) >= 8
    assert {t.split for t in TASKS.values()} == {"train", "eval"}
    for task in TASKS.values():
        assert 1 <= len(task.repo) <= 3 and task.solution, task.task_id
        assert all(len(text.splitlines()) < 40 for text in task.repo.values()), task.task_id
        assert set(task.solution) <= set(task.repo), task.task_id


@pytest.mark.parametrize("task_id", sorted(TASKS))
async def test_a_task_is_broken_as_given_and_fixed_by_its_solution(task_id):
    task = TASKS[task_id]
    shell = RepoShell(task, CommandSandbox())
    try:
        before = await shell.score(30)
        write_files(shell.repo, task.solution)
        after = await shell.score(30)
    finally:
        shell.close()
    assert before.total == after.total == task.num_tests and before.detail == after.detail == ""
    assert before.reward < 1.0
    assert after.reward == 1.0


async def test_commands_share_the_repository_and_nothing_else():
    shell = RepoShell(TASKS["calc_add"], CommandSandbox())
    try:
        first = await shell.run("echo kept > note.txt; echo gone > /tmp/scratch; export X=1; pwd", {"PAGER": "cat"})
        second = await shell.run("cat note.txt; cat /tmp/scratch; echo X=$X PAGER=$PAGER; git log --oneline | wc -l")
        slow = await shell.run("sleep 30")
    finally:
        shell.close()
    assert first.returncode == 0 and first.output.strip().endswith("/repo")
    assert second.output.splitlines()[0] == "kept"
    assert "No such file or directory" in second.output  # /tmp is the sandbox's own, per command
    assert "X= PAGER=\n" in second.output  # every command is a fresh shell; env only as sent
    assert second.output.strip().endswith("1")  # the copy is a git repository with one commit
    assert slow.returncode == -1 and "timed out" in slow.exception_info


async def test_without_isolation_the_repository_is_still_the_working_directory():
    shell = RepoShell(TASKS["calc_add"], CommandSandbox(isolation="none"))  # chosen explicitly: no namespaces
    try:
        await shell.run("sed -i '3s/a - b/a + b/' calc.py")
        score = await shell.score(30)
    finally:
        shell.close()
    assert score.reward == 1.0


def test_a_bad_task_file_is_refused(tmp_path):
    bad = tmp_path / "escape.toml"
    bad.write_text('split = "train"\nproblem = "p"\n[repo]\n"../x.py" = "1"\n[hidden]\n"test_a.py" = "x"\n')
    with pytest.raises(ValueError, match="must stay inside"):
        load_task(bad)
    none = tmp_path / "notests.toml"
    none.write_text('split = "train"\nproblem = "p"\n[repo]\n"a.py" = "1"\n[hidden]\n"test_a.py" = "x = 1"\n')
    with pytest.raises(ValueError, match="no test method"):
        load_task(none)


def test_group_ids_name_their_tasks():
    rows = prompt_rows(TASKS, "eval")
    assert {r["id"] for r in rows} == {f"eval-{t.task_id}" for t in TASKS.values() if t.split == "eval"}
    assert rows[0]["messages"] == [{"role": "user", "content": TASKS[task_id_of(rows[0]["id"] + "@e0")].problem}]
    assert task_id_of("train-calc_add@e3") == "calc_add"
    assert task_id_of("eval/eval-first_n@e0") == "first_n"
    with pytest.raises(ValueError, match="names no task"):
        task_id_of("g0")


def test_the_section_needs_its_source_and_fits_the_gateway_timeout():
    base = ["rollout.agent.default_agent=gateway", "rollout.agent.mini_swe.tasks=workloads/swe_tasks"]
    with pytest.raises(ValueError, match='data.source = "mini_swe"'):
        load_config(None, base)
    with pytest.raises(ValueError, match="not less than rollout.agent.gateway.timeout_s"):
        load_config(None, [*base, "data.source=mini_swe", "rollout.agent.gateway.timeout_s=60"])
    with pytest.raises(ValueError, match=r"configure them in \[rollout.agent.mini_swe\]"):
        load_config(None, ["data.source=mini_swe"])
    cfg = load_config(REPO / "configs" / "mini_swe_tiny.toml")
    assert cfg.rollout.agent.mini_swe is not None and cfg.data.source == "mini_swe"


def test_the_prepared_config_runs_the_episode_program_on_the_written_prompts(tmp_path):
    cfg = load_config(REPO / "configs" / "mini_swe_tiny.toml")
    section = cfg.rollout.agent.mini_swe
    assert section is not None
    files = {s: tmp_path / f"{s}.jsonl" for s in ("train", "eval")}
    for split, path in files.items():
        path.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(TASKS, split)))
    prepared = section.model_copy(
        update={
            "config": resolve_config(section.config),
            "prepared": PreparedMiniSwe(python="/venv/bin/python", train_file=str(files["train"]),
                                        eval_file=str(files["eval"])),
        }
    )  # fmt: skip
    gateway = (cfg.rollout.agent.gateway or GatewayConfig()).model_copy(
        update={"command": episode_command(prepared, "policy")}
    )
    run = cfg.with_mini_swe(prepared, gateway)
    assert run.data.source == str(files["train"]) and run.eval.source == str(files["eval"])
    command = run.rollout.agent.gateway.command
    assert command[1:4] == ["-I", "-m", "streamrl.rollout.mini_swe.episode"]
    spec = json.loads(command[4])
    assert spec["model"] == "openai/policy" and spec["mini_swe"]["prepared"]["python"] == "/venv/bin/python"
    assert str(PACKAGE / "mini_compact.yaml") in spec["mini_swe"]["config"]  # found by name in the package
