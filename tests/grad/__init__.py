"""Tests of lightning_hetero.grad: compression hooks, non-finite steps, periodic sync, per-rank precision."""
