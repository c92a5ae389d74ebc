"""Wiring tbo into one vLLM model runner: the engine built on it (`engine`), the scoped patches that hand vLLM each
step's decision (`patches`), the layer loop that runs a step's layers as tbo ops (`loop`, in per-microbatch forward
contexts: `contexts`), which forward each step runs (`forwards`: vLLM's own or the loop, compiled or eager), data
parallelism (`dp`) and the MTP drafter's pass (`draft`).
"""
