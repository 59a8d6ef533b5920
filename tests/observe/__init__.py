"""Tests of lightning_hetero.observe: the monitor, doctor and what a person reads in a log."""
