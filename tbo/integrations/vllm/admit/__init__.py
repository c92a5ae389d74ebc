"""Admission: every check that runs before the weights load (`checks.check_engine`: vLLM's version, parallel
settings, compiled mode and CUDA graphs, speculative decoding, quantization, AFD), each refusal naming the setting and
what is accepted, and `catalog`: the walk over vLLM's registry that says ahead of time what admission by structure
(`tbo.integrations.vllm.model.structure`, at load) will decide.
"""
