"""Executors: run a compiled schedule of op stages over one or more microbatches."""

from tbo.core.executors.overlapped import execute_operations, execute_overlapped_operations, run_schedule

__all__ = ["execute_operations", "execute_overlapped_operations", "run_schedule"]
