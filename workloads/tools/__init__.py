"""Example tools for tests, benchmarks and demos."""
