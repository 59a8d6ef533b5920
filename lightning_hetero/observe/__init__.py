"""Observation: the monitor (where each rank's time goes), its report, and the ``doctor`` command."""
