"""Tools that read strategies and schedules, and never run inside a step: lint, trace, simulate and the `tbo` CLI."""
