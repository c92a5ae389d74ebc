"""Communication: the expert-parallel backend an engine dispatches through (`backend`: tbo's all-to-all or DeepEP,
a link emulated around it), tbo's all-to-all over vLLM's expert-parallel group (`ep`), and vLLM's own collectives
under tbo's deadline (`bounded`).
"""
