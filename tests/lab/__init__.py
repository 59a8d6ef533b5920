"""Tests of lightning_hetero.lab: the emulated lab, hosts and the paced link between them."""
