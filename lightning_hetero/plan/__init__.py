"""The plan: each rank's capacity (declared, published or profiled), its share of the global batch, rebalancing."""
