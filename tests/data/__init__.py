"""Tests of lightning_hetero.data: the batch sampler, other samplers, streams, token costs, micro-batches."""
