"""The ground floor: what every package shares and nothing else.

Atomic writes and the locked build of a cached folder (`atomic`), gather with a deadline (`aio`), the
name registry (`registry`), the policy-version vocabulary (`versions`), fault injection points
(`faults`), per-process memory (`memory`), the metrics catalogue (`catalogue`), a thread-safe
`ast.parse` (`syntax`), the run directory with its records and the one rule for a complete
checkpoint (`run_dir`), and the lifecycle trace (`trace`; its files on disk and their cap:
`trace_segments`). Modules here import only the standard library, numpy and each other; every other
package may import them (tests/test_layout.py keeps that so).
"""
