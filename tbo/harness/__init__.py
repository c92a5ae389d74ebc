"""What examples, benchmarks and tests share: workloads, timing, process launch and the AFD runner.

No library module imports this package (`tests/test_layering.py` enforces it): it is how we exercise tbo, not tbo.
"""
