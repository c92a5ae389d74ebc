"""Test support shipped with the library: deterministic MoE data and the DeepEP CPU stand-in.

Users testing their own strategies on CPU need the same tools we do, so these live in the package, not in tests/.
"""
