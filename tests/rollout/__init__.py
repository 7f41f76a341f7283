"""Tests of rollout/: engines, routing, models."""
