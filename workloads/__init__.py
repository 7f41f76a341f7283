"""Workloads: tools, interactions and programs the tests, benchmarks and demos run against (a tool that
sleeps, one that leaves an fsynced ledger line per execution, an MCP example server, the sandbox escape
programs, an environment with long-tailed latency). Not part of the trainer: nothing in the library
packages imports them; configs name them by class path like any user tool.
"""
