"""Tests of lightning_hetero.strategies: the strategies' surface, FSDP, launch paths."""
