"""Benchmarks behind `afabric bench ...`: each reports, none asserts."""
