"""The seam between a framework and tbo: one step split, run and merged (`model_forward_maybe_tbo`), with the SM
budget a strategy asks of DeepGEMM applied while it runs (the budgets themselves are in `tbo.comm.sm_budget`), CUDA
graphs and profiling."""
