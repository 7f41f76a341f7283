"""Terminal escape injection: model and tool text reaches the console through `streamrl rollout`
(`streaming/eval.console_text`) and console log lines; neither may carry a working control sequence
(OSC 52 sets the clipboard, CSI 2J clears the screen). rich drops BEL but not ESC."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

from rich.console import Console

from streamrl.observability.safe_text import SafeFormatter, safe_text
from streamrl.streaming.eval import console_text

OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"  # put "rm -rf ~" on the clipboard
CLEAR = "\x1b[2J\x1b[H"  # clear the screen, cursor home
C1_CSI = "\x9b2J"  # the one-byte CSI of C1


def test_safe_text_escapes_control_characters_but_keeps_newlines_and_tabs():
    text = f"before{OSC52}mid{CLEAR}{C1_CSI}\x00\x7f\r\nnext\tline"
    out = safe_text(text)
    assert not any(c in out for c in "\x1b\x07\x9b\x00\x7f\r")
    assert out == "before\\x1b]52;c;cm0gLXJmIH4=\\x07mid\\x1b[2J\\x1b[H\\x9b2J\\x00\\x7f\\x0d\nnext\tline"
    assert safe_text("plain — ünïcode ✓\n") == "plain — ünïcode ✓\n"


def _render(renderable) -> str:
    buf = io.StringIO()
    Console(file=buf, force_terminal=True, color_system="standard", width=200).print(renderable)
    return buf.getvalue()


def test_the_rollout_view_shows_escapes_instead_of_running_them():
    pieces = {1: "prompt ", 2: f"model says {OSC52}", 3: f"tool says {CLEAR}{C1_CSI}"}
    tokenizer = SimpleNamespace(decode=lambda ids: "".join(pieces[i] for i in ids))
    traj = SimpleNamespace(
        prompt_ids=[1],
        response_ids=[2, 3],
        response_mask=[1, 0],
        policy_versions=[0, 0],
        reward=1.0,
        num_turns=1,
        num_tool_calls=1,
        status="finished",
        finish_reason="stop",
    )
    out = _render(console_text(traj, tokenizer))
    assert "\x1b]52" not in out and "\x1b[2J" not in out and "\x1b[H" not in out and "\x9b" not in out
    assert "\\x1b]52;c;" in out and "\\x1b[2J" in out  # shown, not run


def test_console_log_lines_carry_no_control_sequences():
    record = logging.LogRecord("streamrl.x", logging.INFO, __file__, 1, "tool output: %s", (OSC52 + CLEAR,), None)
    line = SafeFormatter("%(name)s: %(message)s").format(record)
    assert "\x1b" not in line and "\x07" not in line and line.startswith("streamrl.x: tool output: \\x1b]52")


def test_the_console_log_handler_escapes_what_it_prints(monkeypatch):
    from streamrl.observability import logs

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    buf = io.StringIO()
    monkeypatch.setattr(logs, "_console", Console(file=buf, force_terminal=False))
    monkeypatch.setattr(logs.sys, "stderr", buf)
    try:
        logs.setup_console(verbose=True)
        logging.getLogger("streamrl.tools").warning("tool raised: %s", OSC52 + CLEAR)
    finally:
        root.handlers[:] = saved[1]
        root.setLevel(saved[0])
    assert "tool raised: \\x1b]52" in buf.getvalue() and "\x1b" not in buf.getvalue()


def test_actor_log_files_escape_what_a_tool_logs(tmp_path):
    """Actor output goes to RUN_DIR/logs/<actor>-<pid>.log (setup_worker_logging), which operators
    `tail -f`: a log record carrying tool or model text must not drive their terminal either."""
    import subprocess
    import sys

    from streamrl.observability import logs

    code = (
        "import logging; from streamrl.observability import logs; logs.setup_worker_logging(); "
        f"logging.getLogger('streamrl.tools').warning('tool output: %s', {OSC52 + CLEAR!r})"
    )
    env = {**__import__("os").environ, logs.LOG_DIR_ENV: str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    (log,) = tmp_path.glob("*.log")
    text = log.read_text()
    assert "tool output: \\x1b]52" in text and "\x1b" not in text, text
