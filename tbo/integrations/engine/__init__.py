"""What every engine integration of tbo shares, importing no engine: the rules that decide a step's split
(`step`: a step's kind, its plan, speculative verify and draft steps) and the counters of what tbo did (`stats`).

vLLM's integration (`tbo.integrations.vllm`) uses them; another engine's (SGLang's) imports them without vLLM.
"""
