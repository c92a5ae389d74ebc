"""Test support shipped with the library: deterministic MoE data and the DeepEP (V1 and V2) and DeepGEMM CPU stand-ins.

Users testing their own strategies on CPU need the same tools we do, so these live in the package, not in tests/.
"""
