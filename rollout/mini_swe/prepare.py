"""The preparation phase of a mini-swe run: the harness's venv, the tasks' prompts, the gateway command.

`prepare_mini_swe` runs once, before training starts (`streamrl train`, with progress on the console):
it builds (or finds) the venv holding mini-swe-agent and litellm (`rollout/verifiers/venv.py`, the
same builder verifiers environments use), checks the task folder and writes its train and eval
prompts into `RUN_DIR/mini_swe/`. The run's config then gets (`StreamRLConfig.with_mini_swe`)

- `data.source` (and `eval.source` when it is "mini_swe") set to those files;
- `rollout.agent.gateway.command` set to the episode program (`episode.py`) with the section, its
  paths made absolute: the gateway loop runs it per sample against the sample's session, and it writes
  the hidden tests' score as the reward; the server settings of a `[rollout.agent.gateway]` are kept;
- `rollout.agent.mini_swe.prepared` recording the three, saved with the run.

A resume keeps the saved config and only makes sure the venv is still there (`ensure_prepared`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from streamrl.rollout.gateway.config import GatewayConfig
from streamrl.rollout.mini_swe.config import EpisodeSpec, MiniSweConfig, PreparedMiniSwe
from streamrl.rollout.mini_swe.tasks import SPLITS, load_tasks, prompt_rows
from streamrl.rollout.verifiers.venv import ensure_venv, venv_folder

PACKAGE = Path(__file__).parent  # mini configurations shipped here (mini_compact.yaml) are found by name
EPISODE_MODULE = "streamrl.rollout.mini_swe.episode"
LABEL = "mini-swe"


def resolve_config(items: list[str]) -> list[str]:
    """mini's `-c` specs with local files made absolute (relative to the working directory, else to this
    package); `key=value` pairs and mini's bundled names are left for mini to read."""
    resolved = []
    for item in items:
        if "=" not in item and Path(item).is_file():
            item = str(Path(item).resolve())
        elif "=" not in item and (PACKAGE / item).is_file():
            item = str(PACKAGE / item)
        resolved.append(item)
    return resolved


def episode_command(cfg: MiniSweConfig, model_name: str) -> list[str]:
    """The gateway command that plays one sample (`episode.py`), in the trainer's interpreter."""
    spec = EpisodeSpec(mini_swe=cfg, model=f"openai/{model_name}")
    return [sys.executable, "-I", "-m", EPISODE_MODULE, spec.model_dump_json()]


def prepare_mini_swe(
    cfg: MiniSweConfig, gateway: GatewayConfig | None, run_dir: Path, say: Callable[[str], None] = print
) -> tuple[MiniSweConfig, GatewayConfig]:
    """Build (or find) the harness's venv and write the tasks' prompts into `RUN_DIR/mini_swe/`; returns
    the section as prepared (paths absolute, `prepared` set) and the gateway config whose `command`
    plays one sample. `StreamRLConfig.with_mini_swe` puts both into the run's config."""
    gateway = gateway or GatewayConfig()
    if gateway.program is not None or gateway.command is not None:
        raise ValueError(
            "[rollout.agent.mini_swe] runs the harness as the gateway's command: leave "
            "rollout.agent.gateway.program / command unset"
        )
    python = ensure_venv(venv_folder(cfg.requirements_key, LABEL), cfg.requirements, say, LABEL)
    tasks = load_tasks(Path(cfg.tasks))
    out_dir = run_dir / "mini_swe"
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in SPLITS:
        rows = prompt_rows(tasks, split)
        if rows:
            files[split] = out_dir / f"{split}.jsonl"
            files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    if "train" not in files:
        raise ValueError(f'{cfg.tasks}: no task has split = "train"')
    say(f"{LABEL}: {len(tasks)} tasks ({', '.join(f'{s} {len(prompt_rows(tasks, s))}' for s in files)}) in {out_dir}")
    prepared = PreparedMiniSwe(
        python=str(python),
        train_file=str(files["train"]),
        eval_file=str(files["eval"]) if "eval" in files else None,
    )
    cfg = cfg.model_copy(
        update={"tasks": str(Path(cfg.tasks).resolve()), "config": resolve_config(cfg.config), "prepared": prepared}
    )
    return cfg, gateway.model_copy(update={"command": episode_command(cfg, gateway.model_name)})


def ensure_prepared(cfg: MiniSweConfig, say: Callable[[str], None] = print) -> None:
    """A prepared run's venv exists (rebuilt where its cache was removed), and so do its prompts."""
    assert cfg.prepared is not None
    ensure_venv(Path(cfg.prepared.python).parent.parent, cfg.requirements, say, LABEL)
    if not Path(cfg.prepared.train_file).is_file():
        raise ValueError(f"the run's mini-swe prompts {cfg.prepared.train_file} are missing")
