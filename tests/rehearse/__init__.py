"""Tests of lightning_hetero.rehearse (`doctor --lab`) and its honesty check, benchmarks/rehearse_check.py."""
