"""`ast.parse` that several threads may call at once.

CPython 3.11 keeps the AST converter's recursion depth in one counter per interpreter, not per
thread (python/cpython#106905 and the change it follows, #95185). When a garbage collection inside
a conversion runs Python code (a finalizer), the interpreter may switch to another thread that
parses as well, and the first parse then fails with `SystemError: AST constructor recursion depth
mismatch`. A finalizer that parses does the same within one thread, and Python 3.11 parses to print
a traceback (to place its ^^^ marks): asyncio's "Task was destroyed but it is pending!", logged from
a collected task together with logging's own error traceback, failed `tests/test_layout.py` in CI
that way.

The calculator tool parses inside rollout workers, which share their process with other threads
(Ray's, vLLM's, tool threads), and the tests parse beside them, so every parse in the library goes
through one (reentrant) lock. A parse that still meets the error (a parser outside the library
raced it) is repeated: parsing is a pure function of its text, and the converter resets its counter
at the start of each parse.
"""

import ast
import threading

_LOCK = threading.RLock()  # reentrant: a finalizer run inside a parse may parse too
_RACE = "AST constructor recursion depth mismatch"
_ATTEMPTS = 5


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """`ast.parse(source, filename, mode)`, safe from the cross-thread race above. Syntax errors
    and every other error pass through unchanged."""
    for _ in range(_ATTEMPTS - 1):
        try:
            with _LOCK:
                return ast.parse(source, filename, mode)
        except SystemError as exc:
            if _RACE not in str(exc):
                raise
    with _LOCK:
        return ast.parse(source, filename, mode)
