"""The model adapter: what a vLLM decoder layer is made of, found by structure (`structure`), the layer as tbo ops
(`layers`, `ep_layer` under expert parallelism), its experts through the quant method (`quant`, `masked`), the ops'
tensor work eager or compiled (`compute`), and the fix for vLLM's shape-dependent rotary kernel (`fixes`).
"""
