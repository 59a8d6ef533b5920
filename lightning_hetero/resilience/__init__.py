"""Resilience: the fault watchdog, atomic and verified checkpoints, per-rank state and resume."""
