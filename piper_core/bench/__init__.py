"""Benchmarks (run with `make bench`); they report what they measure on this machine."""
