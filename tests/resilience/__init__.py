"""Tests of lightning_hetero.resilience: faults, pre-emption, checkpoints and resume."""
