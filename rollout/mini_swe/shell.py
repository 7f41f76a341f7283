"""The harness's shell, in streamrl's sandbox: one repository copy per trajectory, a fresh sandbox per command.

`RepoShell` owns one trajectory's working copy of a task's repository (a temporary folder, a git
repository so `git diff` works) and runs each shell command the agent sends in a sandbox of its own
(`tools/sandbox`): a fresh private /workspace and /tmp, the copy bound read-write at ./repo (the
command's working directory), no network, no host files but the system's and the interpreter's
(read-only), none of the trainer's or the harness's environment (no session key, no reward file), and
the limits of `CommandSandbox`. Only the repository's files persist from one command to the next, as
with mini-swe-agent's own environments, where every command is a fresh subshell.

`score` runs the task's hidden unittest files on the final repository in another fresh sandbox: the
tests are written to a folder of their own (./hidden), never into the repository, so the agent never
saw them and cannot have changed them. The reward is the fraction of their test methods that pass
(`Task.num_tests`, counted here, is the denominator).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from streamrl.rollout.mini_swe.config import CommandSandbox
from streamrl.rollout.mini_swe.tasks import Task, write_files
from streamrl.tools.sandbox import Sandbox, SandboxLimits, SandboxSettings

REPO = "repo"  # the repository's folder in a command's working directory
HIDDEN = "hidden"  # the hidden tests' folder in the scoring run's working directory
# The program each command runs as: the command (stdin) in bash, in ./repo, output and errors merged,
# with the harness's variables (mini's `environment.env`: PAGER=cat, ...), the sandbox interpreter's
# folder first on PATH (`python3` is the interpreter the hidden tests run with), and git trusting the
# copy whoever owns it.
SHELL_PROGRAM = r"""
import os, shutil, subprocess, sys
command = sys.stdin.read()
env = dict(os.environ)
env.update(EXTRA_ENV)
env["PATH"] = os.path.dirname(sys.executable) + ":" + env["PATH"]
env.update(GIT_CONFIG_COUNT="1", GIT_CONFIG_KEY_0="safe.directory", GIT_CONFIG_VALUE_0="*")
shell = shutil.which("bash") or "/bin/sh"
done = subprocess.run([shell, "-c", command], cwd="repo", env=env, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT)
sys.exit(done.returncode if done.returncode >= 0 else 128 - done.returncode)
"""
# The scoring program: the hidden files' tests, the repository after the standard library on the
# import path (a module of the repository never shadows one of Python's), one tagged result line.
SCORE_PROGRAM = r"""
import io, json, os, sys, unittest
sys.path.append(os.path.abspath("repo"))
os.chdir("repo")
suite = unittest.defaultTestLoader.discover(os.path.abspath("../hidden"), pattern="test*.py")
result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
failed = len(result.failures) + len(result.errors) + len(result.skipped) + len(result.unexpectedSuccesses)
print()
print(TAG, json.dumps({"passed": result.testsRun - failed, "run": result.testsRun}))
"""
GIT_ENV = {
    "GIT_AUTHOR_NAME": "streamrl",
    "GIT_AUTHOR_EMAIL": "streamrl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
}


@dataclass(kw_only=True, slots=True)
class CommandResult:
    """One command's outcome, as mini-swe-agent's environments report it."""

    output: str  # stdout and stderr merged (the middle cut past max_output_bytes)
    returncode: int  # -1 when the sandbox ended it (timeout, a limit)
    exception_info: str  # why the sandbox ended it; "" otherwise


@dataclass(kw_only=True, slots=True)
class Score:
    passed: int  # hidden test methods that passed
    total: int  # Task.num_tests
    detail: str  # what went wrong when no result came back

    @property
    def reward(self) -> float:
        return min(self.passed, self.total) / self.total


class RepoShell:
    """One trajectory's repository and the sandbox its commands run in (see the module docstring)."""

    def __init__(self, task: Task, limits: CommandSandbox) -> None:
        self.task, self.limits = task, limits
        self.sandbox = Sandbox(
            SandboxSettings(
                isolation=limits.isolation,
                max_output_bytes=limits.max_output_bytes,
                limits=SandboxLimits(
                    memory_mb=limits.memory_mb,
                    cpu_s=limits.cpu_s,
                    file_mb=limits.file_mb,
                    processes=limits.processes,
                ),
            )
        )
        self.root = Path(tempfile.mkdtemp(prefix="streamrl-mini-swe-"))
        self.repo = self.root / REPO
        self.repo.mkdir()
        write_files(self.repo, task.repo)
        _git_init(self.repo)
        self._give_to_sandbox(self.repo)

    def _give_to_sandbox(self, folder: Path) -> None:
        """As root, the sandbox's programs run as its unprivileged uid: the folder becomes theirs."""
        if os.geteuid() != 0:
            return
        uid = self.sandbox.settings.sandbox_uid
        os.chown(folder, uid, uid)
        for parent, dirs, files in os.walk(folder):
            for name in dirs + files:
                os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)

    async def run(self, command: str, env: dict[str, str] | None = None) -> CommandResult:
        """Run one shell command in a fresh sandbox on the repository."""
        program = f"EXTRA_ENV = {dict(env or {})!r}\n{SHELL_PROGRAM}"
        result = await self.sandbox.run(
            program, command.encode(), timeout_s=self.limits.timeout_s, folders={REPO: str(self.repo)}
        )
        output = result.stdout + result.stderr
        reason = ""
        if result.setup_error:
            raise RuntimeError(f"the sandbox could not run a command: {result.setup_error}")
        if result.timed_out:
            reason = f"the command timed out after {self.limits.timeout_s:g} s"
        elif result.memory_exceeded or result.processes_exceeded or result.output_killed:
            reason = "the command went over the sandbox's limits (memory, processes or output) and was killed"
        elif result.exit_code is None:
            reason = f"the command was killed by signal {result.signal}"
        returncode = -1 if reason else (result.exit_code or 0)
        return CommandResult(output=output, returncode=returncode, exception_info=reason)

    def repo_mb(self) -> float:
        """The repository's size on disk (links not followed)."""
        total = 0
        for parent, dirs, files in os.walk(self.repo):
            for name in dirs + files:
                total += os.lstat(os.path.join(parent, name)).st_size
        return total / (1 << 20)

    async def score(self, timeout_s: float) -> Score:
        """The hidden tests on the repository as it is now (see the module docstring)."""
        hidden = self.root / HIDDEN
        shutil.rmtree(hidden, ignore_errors=True)
        hidden.mkdir()
        write_files(hidden, self.task.hidden)
        self._give_to_sandbox(hidden)
        tag = f"streamrl-score-{secrets.token_hex(8)}"
        program = f"TAG = {tag!r}\n{SCORE_PROGRAM}"
        result = await self.sandbox.run(
            program, timeout_s=timeout_s, folders={REPO: str(self.repo), HIDDEN: str(hidden)}
        )
        total = self.task.num_tests
        for line in reversed(result.stdout.splitlines()):
            if line.startswith(tag + " "):
                counts = json.loads(line[len(tag) + 1 :])
                return Score(passed=int(counts["passed"]), total=total, detail="")
        detail = result.setup_error or f"exit {result.exit_code}, timed out {result.timed_out}: {result.stderr[-300:]}"
        return Score(passed=0, total=total, detail=detail)

    def close(self) -> None:
        self.sandbox.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _git_init(repo: Path) -> None:
    """Make the copy a git repository with one commit, so the agent can diff its changes."""
    if shutil.which("git") is None:
        return
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo.parent), **GIT_ENV}
    env |= {"GIT_COMMITTER_NAME": env["GIT_AUTHOR_NAME"], "GIT_COMMITTER_EMAIL": env["GIT_AUTHOR_EMAIL"]}
    env["GIT_COMMITTER_DATE"] = env["GIT_AUTHOR_DATE"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "initial"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, timeout=30)
