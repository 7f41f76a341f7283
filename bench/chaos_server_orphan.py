"""The `server_orphan` chaos family: a `server_command` engine killed and restarted on the same port
while a server it did not start answers there (docs/security.md, "Inference servers an engine starts").

    python -m bench.chaos --families server_orphan [--seeds 1]

Each engine is its own process running the real code path (`make_engine` -> `VLLMServerEngine` ->
`ServerProcess` -> `server_supervisor.py`) with a `server_command` that starts a stand-in for `vllm
serve`: a small HTTP server speaking the endpoints the engine uses (`/health`, `/v1/completions`
streamed, `/collective_rpc`, `/reset_prefix_cache`), that appends one line per request it receives to
a ledger (its process group, the path, the time) and, like a draining `vllm serve`, keeps answering for
a few seconds after SIGTERM. Every engine, once up, samples tokens and commits weights on its server.

1. **killed and restarted**: engine A is SIGKILLed; engine B starts at once on A's URL while A's
   server still answers (its supervisor is ending it). B must wait for the port, start its own server
   and send every request there.
2. **an orphan answers**: B's supervisor is SIGKILLed, then B: B's server outlives both, an orphan
   answering `/health` forever (what `vllm serve` did to every killed engine before the supervisor).
   Engine C starts on the same URL and must refuse it with a clear error (`PortTakenError`, after
   `server_process.PORT_FREE_WAIT_S`), start nothing, and send the orphan nothing.

Counts (from the ledger and the engines' own reports): requests that reached a server the sending
engine did not start (`requests_to_foreign_servers`, must be 0; generations and weight calls alike),
orphans adopted (must be 0), refusals that named the cause.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 90.0

# argv: port, ledger path, linger seconds after SIGTERM. Answers like `vllm serve` on the paths a
# VLLMServerEngine calls; every request is one ledger line {pgid, method, path, t}.
STAND_IN = r"""
import http.server, json, os, signal, sys, threading, time
port, ledger, linger = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def record(method, path):
    with open(ledger, "a") as f:
        f.write(json.dumps({"pgid": os.getpgid(0), "pid": os.getpid(), "method": method, "path": path,
                            "t": time.time()}) + "\n")
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, body, ctype="application/json"):
        self.send_response(200); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        record("GET", self.path); self._send(b"{}")
    def do_POST(self):
        record("POST", self.path)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path.startswith("/v1/completions"):
            n, chunks = int(body["max_tokens"]), []
            for i in range(n):
                choice = {"token_ids": [7 + i], "logprobs": {"token_logprobs": [-0.5]},
                          "finish_reason": "length" if i == n - 1 else None}
                if i == 0:
                    choice["prompt_token_ids"] = body["prompt"]
                chunks.append("data: " + json.dumps({"choices": [choice]}) + "\n\n")
            self._send(("".join(chunks) + "data: [DONE]\n\n").encode(), "text/event-stream")
        elif self.path.startswith("/collective_rpc"):
            self._send(json.dumps({"results": [True]}).encode())
        else:
            self._send(b"")
    def log_message(self, *args): pass
def drain(signum, frame):  # a draining server: answers a while longer, then exits
    threading.Timer(linger, lambda: os._exit(0)).start()
signal.signal(signal.SIGTERM, drain)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def engine_main(
    url: str, ledger: str, linger_s: float, report: str, port_free_wait_s: float | None, unguarded: bool = False
) -> int:
    """One engine process: build a VLLMServerEngine with the stand-in as its `server_command`, sample
    tokens, commit weights, write what it did to `report`, and live until killed. A refused start is
    reported (exit 3). `unguarded` turns the engine's two guards off (the port-free wait and the owner
    check), as the code was when the finding was made: the case must then count an adoption."""
    import asyncio

    from streamrl.engines import make_engine, server_process
    from streamrl.engines.base import SamplingParams
    from streamrl.engines.config import EngineConfig

    if port_free_wait_s is not None:
        server_process.PORT_FREE_WAIT_S = port_free_wait_s
    if unguarded:
        server_process._wait_port_free = lambda *args: None
        server_process.ServerProcess.check_owner = lambda self: None
    cfg = EngineConfig(
        backend="vllm_server",
        server_urls=[url],
        server_command=[sys.executable, "-c", STAND_IN, "{port}", ledger, str(linger_s)],
        startup_timeout_s=60,
        call_timeout_s=30,
    )
    t0 = time.time()
    try:
        engine = make_engine(cfg, f"engine-{os.getpid()}")
    except Exception as exc:  # the refusal is the outcome under test: report it
        Path(report).write_text(
            json.dumps({"error": f"{type(exc).__name__}: {exc}", "started_at": t0, "ended_at": time.time()})
        )
        return 3

    async def work() -> int:
        out = await engine.generate("r0", [1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0))
        await engine.collective_rpc("commit_weights", args=(1,))
        await engine.reset_prefix_cache()
        return len(out.token_ids)

    num_tokens = asyncio.run(work())
    server_pgid = engine._process.process.pid  # the supervisor leads the server's process group
    Path(report).write_text(
        json.dumps({"server_pgid": server_pgid, "num_tokens": num_tokens, "started_at": t0, "up_at": time.time()})
    )
    time.sleep(3600)
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class _Engines:
    """The engine processes of one case (each in its own session), killed at the end."""

    def __init__(self, root: Path, url: str, ledger: Path, linger_s: float, unguarded: bool = False):
        self.root, self.url, self.ledger, self.linger_s = root, url, ledger, linger_s
        self.unguarded = unguarded
        self.procs: list[subprocess.Popen] = []
        self.orphan_pgid: int | None = None  # the server made an orphan, ended last

    def start(self, name: str, port_free_wait_s: float | None = None) -> tuple[subprocess.Popen, Path]:
        report = self.root / f"{name}.json"
        cmd = [sys.executable, "-m", "bench.chaos_server_orphan", "engine", self.url, str(self.ledger)]
        cmd += [str(self.linger_s), str(report), str(port_free_wait_s or ""), "unguarded" if self.unguarded else ""]
        log = (self.root / f"{name}.log").open("ab")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc, report

    @staticmethod
    def wait_report(proc: subprocess.Popen, report: Path) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if report.exists() and report.read_text():
                return json.loads(report.read_text())
            if proc.poll() is not None and not report.exists():
                return {"error": f"the engine process exited with {proc.returncode} without a report"}
            time.sleep(0.1)
        return {"error": "hang: no report"}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if self.orphan_pgid is not None and _group_alive(self.orphan_pgid):
            os.killpg(self.orphan_pgid, signal.SIGKILL)


def _requests(ledger: Path) -> list[dict]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def _wait_gone(pgid: int, timeout_s: float) -> float | None:
    """Seconds until process group `pgid` is gone, or None if it outlived `timeout_s`."""
    t0 = time.monotonic()
    while _group_alive(pgid):
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(0.05)
    return time.monotonic() - t0


def run_server_orphan(seed: int, root: Path, *, port_free_wait_s: float | None = None, unguarded: bool = False) -> dict:
    """Both phases of the case for `seed` (the kill moment and the drain time are drawn from it);
    `port_free_wait_s` shortens engine C's wait before its refusal (tests), None keeps the engine's
    own; engine B always waits as long as the engine does. `unguarded`: the engines without their
    guards (`engine_main`), to show the case detects what the finding described."""
    rng = random.Random(f"server_orphan-{seed}")
    linger_s, kill_delay_s = rng.uniform(2.0, 5.0), rng.uniform(0.0, 1.0)
    if unguarded:  # B adopts A's draining server: it must outlive B's start-up and calls on a loaded machine
        linger_s = 20.0
    case_dir = root / f"server_orphan-s{seed}"
    case_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ledger = case_dir / "requests.jsonl"
    engines = _Engines(case_dir, f"http://127.0.0.1:{port}", ledger, linger_s, unguarded)
    out: dict = {"name": "server_orphan", "seed": seed, "linger_s": round(linger_s, 2), "faults_injected": 0}
    try:
        _run_phases(engines, port, ledger, kill_delay_s, port_free_wait_s, out)
    except RuntimeError as exc:  # an engine that did not come up: the case could not run
        out["error"] = str(exc)
    finally:
        engines.close()
    out["completed"] = "error" not in out
    out["hangs"] = int(str(out.get("refusal")).startswith("hang"))
    return out


def _run_phases(
    engines: _Engines, port: int, ledger: Path, kill_delay_s: float, port_free_wait_s: float | None, out: dict
) -> None:
    """Phase 1 (A killed, B restarted) and phase 2 (B orphaned, C refused); fills `out`."""
    # 1. engine A up, then SIGKILLed; B started at once on the same URL
    proc_a, report_a = engines.start("engine_a")
    a = engines.wait_report(proc_a, report_a)
    if "error" in a:
        raise RuntimeError(f"engine A did not come up: {a['error']}")
    time.sleep(kill_delay_s)
    os.killpg(proc_a.pid, signal.SIGKILL)
    out["faults_injected"] += 1
    proc_b, report_b = engines.start("engine_b")
    out["killed_engine_server_answered_at_restart"] = _answers(port)
    gone = _wait_gone(a["server_pgid"], 60.0)
    out["killed_engine_server_gone_after_s"] = round(gone, 2) if gone is not None else None
    b = engines.wait_report(proc_b, report_b)
    out["restarted_engine"] = {k: b.get(k) for k in ("num_tokens", "error")}
    if "error" in b:
        raise RuntimeError(f"engine B did not come up: {b['error']}")
    out["restarted_engine_waited_s"] = round(b["up_at"] - b["started_at"], 2)
    # 2. B's supervisor, then B, SIGKILLed: B's server is an orphan that keeps answering
    orphan_pgid = engines.orphan_pgid = b["server_pgid"]
    os.kill(orphan_pgid, signal.SIGKILL)
    os.killpg(proc_b.pid, signal.SIGKILL)
    out["faults_injected"] += 2
    time.sleep(1.0)
    out["orphan_answers"] = _answers(port)  # a TCP connect: no request reaches its ledger
    orphaned_at = time.time()
    proc_c, report_c = engines.start("engine_c", port_free_wait_s)
    c = engines.wait_report(proc_c, report_c)
    out["orphan_answers_after_refusal"] = _answers(port)
    out["refusal"] = c.get("error")
    out["refused_after_s"] = round(c["ended_at"] - c["started_at"], 2) if "ended_at" in c else None
    out |= _count(_requests(ledger), a, b, orphan_pgid, orphaned_at, c)


def _count(requests: list[dict], a: dict, b: dict, orphan_pgid: int, orphaned_at: float, c: dict) -> dict:
    """What reached which server: each engine's requests must reach its own server only."""
    by_server = {a["server_pgid"]: "engine_a", b["server_pgid"]: "engine_b"}
    # every request from B's start on is B's (A is dead); one at A's server went to a server B did not start
    b_requests = [r for r in requests if r["t"] >= b["started_at"]]
    to_a_after_kill = [r for r in b_requests if r["pgid"] == a["server_pgid"]]
    to_orphan = [r for r in requests if r["pgid"] == orphan_pgid and r["t"] >= orphaned_at]
    unknown = [r for r in requests if r["pgid"] not in by_server]  # a server C started (must be none)
    error = str(c.get("error"))
    adopted = int(c.get("error") is None)
    return {
        "requests": len(requests),
        "requests_by_server": {name: sum(r["pgid"] == g for r in requests) for g, name in by_server.items()},
        "requests_to_foreign_servers": len(to_a_after_kill) + len(to_orphan),
        "generations_to_foreign_servers": sum(
            r["path"].startswith("/v1/completions") for r in [*to_a_after_kill, *to_orphan]
        ),
        "weight_calls_to_foreign_servers": sum(
            r["path"].startswith("/collective_rpc") for r in [*to_a_after_kill, *to_orphan]
        ),
        "servers_started_by_refused_engine": len({r["pgid"] for r in unknown}),
        "orphans_adopted": adopted,
        "refused_clearly": int(not adopted and "PortTakenError" in error and "already answers" in error),
    }


if __name__ == "__main__" and sys.argv[1:2] == ["engine"]:
    url, ledger, linger, report, wait, mode = sys.argv[2:8]
    wait_s = float(wait) if wait else None
    raise SystemExit(engine_main(url, ledger, float(linger), report, wait_s, unguarded=mode == "unguarded"))
