"""Shared test settings: one torch thread per process, as on a 2-core CI machine running several ranks."""

import torch

torch.set_num_threads(1)
