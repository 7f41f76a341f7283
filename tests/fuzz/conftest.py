"""Fuzz tests (hypothesis): every input parser of streamrl, fed random and mutated input, must answer
with a well-formed result or its documented error type, never another exception and never a hang.

Reproducible: each test is `derandomize=True` (examples derived from the test itself, the same on
every run and in CI), with a modest `max_examples`, an explicit `deadline`, and a pytest-timeout bound.
"""
