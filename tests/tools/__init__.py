"""Tests of tools/: the tool interface, calculator, function tools, the code interpreter and its sandbox."""
