"""Tests of engines/: the engine interface, the in-process vLLM engine, the server engines, the fake."""
