"""The gradient path: exact capacity weighting, per-rank precision with one loss scale, compressed communication."""
