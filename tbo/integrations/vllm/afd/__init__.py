"""Attention-FFN disaggregation inside vLLM: vLLM's engine as the attention side, ``tbo afd-ffn`` as the FFN side.

`config` is the ``additional_config["tbo"]["afd"]`` schema (no vLLM import), `attention` what the engine runs in
place of each decoder layer's FFN (send the stage's hidden states, Yield, receive), `ffn` the FFN server behind
``tbo afd-ffn``. The transport, the wire format and the FFN loop are `tbo.afd`'s own. See docs/vllm-afd.md.
"""
