"""Tests of lightning_hetero.plan: the split arithmetic, profiled capacities, live rebalancing."""
