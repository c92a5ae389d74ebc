"""DeepSeek decode through tbo: the `deepseek_decode` strategy on the reference model, TBO vs single batch.

    python examples/deepseek_decode.py                          # one process
    python examples/deepseek_decode.py --ranks 2 --link 50,0.003  # 2 gloo ranks, emulated 50 us / 3 MB/s link
    torchrun --nproc-per-node 2 examples/deepseek_decode.py     # the same under torchrun
"""

from tbo.harness.workload import example_main

if __name__ == "__main__":
    example_main("deepseek", "decode")
