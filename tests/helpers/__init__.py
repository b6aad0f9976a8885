"""Builders shared by the tests and the benchmarks (which may import them; tests never import benchmarks)."""
