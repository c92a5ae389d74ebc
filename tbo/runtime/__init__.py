"""The seam between a framework and tbo: one step split, run and merged (`model_forward_maybe_tbo`), and the SM
budgets that a strategy asks of DeepGEMM and DeepEP while it runs."""
