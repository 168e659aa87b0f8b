"""Benchmarks (``verl-quads bench ...``): each reports ratios against a baseline timed in the same run."""
