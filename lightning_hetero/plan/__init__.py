"""The plan: each rank's capacity (declared, published or profiled), its share of the global batch, rebalancing; the
memory plan of a sharded model and the blocks it counts."""
