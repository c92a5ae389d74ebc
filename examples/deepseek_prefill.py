"""DeepSeek prefill through tbo: the `deepseek_prefill` strategy (two-chunk splits included), TBO vs single batch.

    python examples/deepseek_prefill.py
    python examples/deepseek_prefill.py --ranks 3 --link 50,0.005
    torchrun --nproc-per-node 2 examples/deepseek_prefill.py
"""

from tbo.harness.workload import example_main

if __name__ == "__main__":
    example_main("deepseek", "prefill")
