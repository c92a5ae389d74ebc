"""Communication: timeout-bounded waits, and (with the expert-parallel backends) dispatch and combine."""

from .wait import DEFAULT_TIMEOUT_S, wait_work

__all__ = ["DEFAULT_TIMEOUT_S", "wait_work"]
