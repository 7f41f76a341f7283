"""Example interactions for tests and benchmarks."""
