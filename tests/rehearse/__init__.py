"""Tests of lightning_hetero.rehearse: the `doctor --lab` rehearsal, and its honesty check (benchmarks/rehearse_check.py)."""
