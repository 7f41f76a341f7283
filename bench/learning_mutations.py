"""Mutation check of the CI learning test: each planted bug must make `tests/streaming/test_learning.py`
fail. A learning test that still passes with the weight sync broken proves nothing.

Each mutation is a textual edit of one file in a copy of the committed tree (HEAD; the repository
itself is never touched); the test then runs in that copy (`PYTHONPATH` puts the copy first). Writes
bench/results/learning_mutations.json: per mutation, whether the test failed and the line that said so.

    python -m bench.learning_mutations [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = "tests/streaming/test_learning.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    why: str


MUTATIONS = [
    Mutation(
        "engine_commit_skipped",
        "weight_sync/worker_extension.py",
        "        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]",
        "        sum(1 for _ in weights)  # MUTATION: staged and checked, never loaded",
        "the engine keeps serving its first weights while every sync reports success",
    ),
    Mutation(
        "advantage_sign_flipped",
        "learner/advantages.py",
        "    return centered / (std[inverse] + eps)",
        "    return -centered / (std[inverse] + eps)  # MUTATION",
        "GRPO pushes towards the worse samples of each group",
    ),
    Mutation(
        "partial_sync",
        "weight_sync/worker_extension.py",
        "        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]",
        "        self.reload_weights(weights_iterator=(w for i, w in enumerate(weights) if i % 2 == 0))  # MUTATION",
        "every other tensor of each sync is dropped on the engine side",
    ),
    Mutation(
        "versions_shifted_by_one",
        "learner/step_inputs.py",
        "token_lag(policy_version, batch.policy_versions)",
        "token_lag(policy_version, batch.policy_versions - 1)",
        "every token looks one version staler than it is to the correction",
    ),
]


def copy_tree(dst: Path) -> Path:
    """The committed tree (HEAD) of the repository, under dst/streamrl."""
    root = dst / "streamrl"
    root.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def run_mutation(mutation: Mutation | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="streamrl-mutation-") as tmp:
        root = copy_tree(Path(tmp))
        if mutation is not None:
            target = root / mutation.path
            text = target.read_text()
            if text.count(mutation.old) != 1:
                raise RuntimeError(f"{mutation.name}: anchor not found once in {mutation.path}")
            target.write_text(text.replace(mutation.old, mutation.new))
        env = dict(os.environ, PYTHONPATH=tmp, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", TEST],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )
        lines = proc.stdout.splitlines()
        said = next((ln for ln in lines if ln.startswith("E ") and "assert" in ln), None) or (
            lines[-1] if lines else ""
        )
        return {
            "name": mutation.name if mutation else "none (the tree as it is)",
            "why": mutation.why if mutation else "",
            "test_failed": proc.returncode != 0,
            "exit_code": proc.returncode,
            "wall_s": round(time.monotonic() - t0, 1),
            "evidence": said.strip()[:400],
        }


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", nargs="*", default=None, help="mutation names (default: all, plus the unmutated tree)"
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/learning_mutations.json"))
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
    results = [] if args.only else [run_mutation(None)]
    for mutation in chosen:
        results.append(run_mutation(mutation))
        print(json.dumps(results[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    out = {
        "command": "python -m bench.learning_mutations " + " ".join(argv if argv is not None else sys.argv[1:]),
        "test": TEST,
        "commit": commit,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    clean = [r for r in results if r["name"].startswith("none")]
    ok = all(r["test_failed"] for r in results if not r["name"].startswith("none")) and not any(
        r["test_failed"] for r in clean
    )
    print(f"wrote {args.out}: {'every mutation failed the test' if ok else 'NOT every mutation was caught'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
