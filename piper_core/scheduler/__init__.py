"""Hybrid-parallel plan search: enumerate, reject with reasons, rank by predicted throughput."""
