"""Benchmarks: kernels, end-to-end, speed of light, detection.

Run from the repo root as ``python -m benchmarks.<name>``.
"""
