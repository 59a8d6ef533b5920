"""Thin Lightning strategies: lifecycle glue that composes the hetero core with one parallelism each."""
