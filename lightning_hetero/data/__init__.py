"""The data path: one global order per epoch, cut into per-rank shares (samplers, streams, tokens, micro-batches)."""
