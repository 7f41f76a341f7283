"""`LedgerCalculator`: the calculator with a side effect that must happen at most once.

Every execution first appends one line to an append-only ledger file (JSON: instance id = trajectory
id, call id, arguments, pid) and fsyncs it, then answers like the calculator. A ledger line is an
effect on the world outside the trajectory (the way a booking, a payment or a file write would be),
so the tool is not idempotent: the agent loop journals and snapshots its calls before they run, and a
call that was in flight when its process died is answered "interrupted" instead of being run again.

The chaos suite gives it to a tool-calling model and counts ledger lines per (trajectory, call id)
after worker kills, kills mid-tool and whole-job SIGKILLs: any count above one is a repeated side
effect (`streaming.invariants`, I5). Configure it under the calculator's name so a model trained on
the calculator calls it:

    tools:
      - name: calculator
        class_name: streamrl.workloads.tools.ledger:LedgerCalculator
        config: {ledger_path: /abs/path/tool_ledger.jsonl}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from streamrl.tools.base import ToolExecution
from streamrl.tools.calculator import CalculatorConfig, CalculatorTool
from streamrl.tools.executor import current_call


class LedgerConfig(CalculatorConfig):
    ledger_path: str


class LedgerCalculator(CalculatorTool[LedgerConfig]):
    config_model = LedgerConfig
    config: LedgerConfig
    idempotent = False  # every run appends a line: running a call twice is visible

    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> ToolExecution:
        call = current_call()
        record = {
            "instance_id": instance_id,
            "call_id": call.call_id if call is not None else None,
            "arguments": parameters,
            "pid": os.getpid(),
        }
        path = Path(self.config.ledger_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write() of one line: appends from several processes never interleave
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return await super().execute(instance_id, parameters)


def read_ledger(path: str | Path) -> list[dict[str, Any]]:
    """The ledger's complete lines (a torn last line, from a kill mid-write, is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
