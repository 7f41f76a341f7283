"""The virtual environment an outside program runs in: one per requirement set, built once, cached.

verifiers and the environments written for it pin their own `openai`, `mcp`, `datasets` and more, and a
coding harness such as mini-swe-agent brings litellm and its pins (`rollout/mini_swe/`); none need agree
with the trainer's (the trainer's venv holds vLLM's and the Agents SDK's). So each such program runs in a
venv of its own, made with `python -m venv` and `pip install` of its requirement set (the configured
package index; nothing else is fetched), under `$STREAMRL_CACHE/<kind>-venvs/<hash of the sorted
requirements>` (`kind`: "verifiers", "mini-swe"). Builders of one folder take turns
on a file lock beside it; a folder is complete when its `READY.json` (written last) exists, and a folder
without it (a build that died) is removed and built again.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from streamrl.models import cache_root

READY = "READY.json"
PIP_TIMEOUT_S = 1800.0
HEARTBEAT_S = 30.0  # how often a running install says it is still running
_SHOWN = ("Collecting ", "Installing collected", "Successfully installed", "ERROR")


def venv_folder(key: str, kind: str = "verifiers") -> Path:
    return cache_root() / f"{kind}-venvs" / key


def venv_python(folder: Path) -> Path:
    return folder / "bin" / "python"


def ensure_venv(folder: Path, requirements: list[str], say: Callable[[str], None], label: str = "verifiers") -> Path:
    """The interpreter of the venv at `folder` holding `requirements`, built first when it is not
    complete. `say` gets one line per step (the console of `streamrl train`), each led by `label`."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    if (folder / READY).exists():
        return venv_python(folder)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / READY).exists():
            _build(folder, requirements, lambda line: say(f"{label}: {line}"))
    return venv_python(folder)


def _build(folder: Path, requirements: list[str], say: Callable[[str], None]) -> None:
    if folder.exists():
        shutil.rmtree(folder)  # a build that did not finish
    started = time.monotonic()
    say(f"creating the venv {folder} ({' '.join(requirements)})")
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, capture_output=True, timeout=300)
    log = folder / "pip-install.log"
    command = [str(venv_python(folder)), "-m", "pip", "install", "--progress-bar", "off", *requirements]
    with open(log, "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        done = threading.Event()
        threading.Thread(target=_heartbeat, args=(done, started, say), daemon=True).start()
        try:
            for line in proc.stdout:
                if line.startswith(_SHOWN):
                    say(f"pip: {line.strip()[:160]}")
            status = proc.wait(timeout=PIP_TIMEOUT_S)
        finally:
            done.set()
            if proc.poll() is None:
                proc.kill()
    if status != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"pip install {' '.join(requirements)} into {folder} failed ({status}):\n{tail}")
    (folder / READY).write_text(json.dumps({"requirements": requirements, "built_s": time.monotonic() - started}))
    say(f"venv ready in {time.monotonic() - started:.0f} s")


def _heartbeat(done: threading.Event, started: float, say: Callable[[str], None]) -> None:
    while not done.wait(HEARTBEAT_S):
        say(f"still installing ({time.monotonic() - started:.0f} s)")
