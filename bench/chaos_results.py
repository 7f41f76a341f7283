"""The chaos suite's results file (bench/results/chaos.json): merging a partial run into it and
re-checking kept run directories with this checkout's checker (`python -m bench.chaos --merge`,
`--recheck DIR`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

from bench.chaos import REPO, ScenarioResult, summarize


def merge(out_path: Path, results: list[ScenarioResult], command: str, wall_s: float) -> int:
    """Put `results` into --out in place of the same scenarios' earlier results of the same seeds (the
    others stay), recount the summary over all of them and note the run under `merged`."""
    from bench.chaos_families import write_by_kind

    data = json.loads(out_path.read_text()) if out_path.exists() else {}
    names = {r.name for r in results}
    kept = [r for r in data.get("results", []) if (r["name"], r["seed"]) not in {(x.name, x.seed) for x in results}]
    fields = ScenarioResult.__dataclass_fields__
    every = [ScenarioResult(**{k: r[k] for k in fields if k in r}) for r in kept] + results
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    data["results"] = kept + [asdict(r) for r in results]
    data["summary"] = summarize(every)
    data.setdefault("merged", []).append(
        {
            "command": command,
            "commit": commit.strip(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "wall_s": round(wall_s, 1),
            "scenarios": sorted(names),
            "summary": summarize(results),
        }
    )
    out_path.write_text(json.dumps(data, indent=1))
    write_by_kind(out_path)
    print(json.dumps(data["merged"][-1]["summary"], indent=1))
    return 0


def recheck(out_path: Path, runs: Path, argv: list[str]) -> int:
    """Re-run the invariant checker over kept run directories; the report the run wrote is kept per
    scenario as `invariants_at_run`."""
    from streamrl.streaming.invariants import check_run

    data = json.loads(out_path.read_text())
    results = []
    for r in data["results"]:
        r.setdefault("invariants_at_run", r["invariants"])
        r["invariants"] = asdict(check_run(runs / f"{r['name']}-s{r['seed']}"))
        results.append(ScenarioResult(**{k: r[k] for k in ScenarioResult.__dataclass_fields__ if k in r}))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    data["summary"] = summarize(results)
    data["rechecked"] = {"command": "python -m bench.chaos " + " ".join(argv), "checker_commit": commit.strip()}
    out_path.write_text(json.dumps(data, indent=1))
    print(json.dumps(data["summary"], indent=1))
    return 0
