"""The preparation phase of a verifiers run: the environment's venv, its dataset, the gateway command.

`prepare_environment` runs once, before training starts (`streamrl train`, with progress on the
console): it builds (or finds) the environment's venv (`venv.py`) and runs the runner script there to
dump the environment's train and eval splits into `RUN_DIR/verifiers/` (`runner.py dump`). The run's
config then gets (`StreamRLConfig.with_verifiers`)

- `data.source` (and `eval.source` when it is "verifiers") set to those files, so the prompt stream,
  admission, held-out evaluation and a resume's prompt check treat them like any dataset file;
- `rollout.agent.gateway.command` set to the runner's `rollout` command in that venv: the gateway loop
  runs it per sample against the sample's session, and it writes the rubric's reward
  (`rollout/gateway/command.py`); the server settings of a `[rollout.agent.gateway]` section are kept;
- `rollout.agent.verifiers.prepared` recording the three, saved with the run.

A resume keeps the saved config and only makes sure the venv is still there (`ensure_prepared`).
This module knows nothing of the run's whole config: the driver puts the pieces in.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.verifiers.config import PreparedVerifiers, VerifiersConfig
from streamrl.rollout.verifiers.venv import ensure_venv, venv_folder

RUNNER = str(Path(__file__).with_name("runner.py"))  # run by the environment venv's python
DUMP_TIMEOUT_S = 900.0


def runner_command(python: str | Path, spec: dict) -> list[str]:
    """The gateway command that plays one sample (`runner.py rollout`)."""
    return [str(python), "-I", RUNNER, "rollout", json.dumps(spec, sort_keys=True)]


def dump_splits(python: str | Path, spec: dict, out_dir: Path) -> dict[str, int]:
    """Run `runner.py dump` in the venv; returns the row count of each split written."""
    proc = subprocess.run(
        [str(python), "-I", RUNNER, "dump", json.dumps(spec), str(out_dir)],
        capture_output=True,
        text=True,
        timeout=DUMP_TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise ValueError(
            f"verifiers environment {spec['environment']!r}: dumping its dataset failed:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare_environment(
    vcfg: VerifiersConfig, gateway: GatewayConfig | None, run_dir: Path, say: Callable[[str], None] = print
) -> tuple[PreparedVerifiers, GatewayConfig]:
    """Build (or find) the environment's venv and dump its splits into `RUN_DIR/verifiers/`; returns what
    was made and the gateway config whose `command` plays one sample (the server settings of `gateway`
    kept). `StreamRLConfig.with_verifiers` puts both into the run's config."""
    gateway = gateway or GatewayConfig()
    if gateway.program is not None or gateway.command is not None:
        raise ValueError(
            "[rollout.agent.verifiers] runs the environment as the gateway's program: leave "
            "rollout.agent.gateway.program / command unset"
        )
    python = ensure_venv(venv_folder(vcfg.requirements_key), vcfg.requirements, say)
    spec = vcfg.spec([str(Path(p).resolve()) for p in vcfg.paths], model=gateway.model_name)
    out_dir = run_dir / "verifiers"
    started = time.monotonic()
    say(f"verifiers: loading {vcfg.environment} and writing its dataset to {out_dir}")
    counts = dump_splits(python, spec, out_dir)
    say(f"verifiers: {counts} rows in {time.monotonic() - started:.0f} s")
    prepared = PreparedVerifiers(
        python=str(python),
        train_file=str(out_dir / "train.jsonl"),
        eval_file=str(out_dir / "eval.jsonl") if "eval" in counts else None,
    )
    return prepared, gateway.model_copy(update={"command": runner_command(python, spec)})


def ensure_prepared(vcfg: VerifiersConfig, say: Callable[[str], None] = print) -> None:
    """A prepared run's venv exists (rebuilt where its cache was removed), and so does its dataset."""
    assert vcfg.prepared is not None
    ensure_venv(Path(vcfg.prepared.python).parent.parent, vcfg.requirements, say)
    if not Path(vcfg.prepared.train_file).is_file():
        raise ValueError(f"the run's verifiers dataset {vcfg.prepared.train_file} is missing")
