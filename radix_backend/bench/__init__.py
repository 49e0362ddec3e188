"""Benchmarks run by `radix-backend bench NAME`: each runs a workload and its baseline side by side."""
