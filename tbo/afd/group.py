"""`AFDGroup`: a two-sided process group of AFD's own, outside ``torch.distributed``'s default group.

An engine that serves requests (vLLM) owns the default process group of its processes; its FFN servers are not in
it. So the attention side and an FFN server meet here instead: the FFN server listens (a ``TCPStore`` on the
address it was told, loopback by default), publishes a small JSON description of what it serves, and both join a
gloo (CPU) or NCCL (CUDA) process group that is registered nowhere. `TorchDistributedAFDConnector` sends and
receives through it as it does through a registered group.

Nothing read from the network here is unpickled or evaluated: the store carries JSON text that is parsed and
checked field by field, and the tensors that follow carry `AFDMeta` headers the connector checks.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch

__all__ = ["AFDGroup", "AFDPeerError", "parse_address", "AFD_INFO_KEY"]

#: the store key under which the FFN server publishes what it serves (JSON)
AFD_INFO_KEY = "tbo-afd/ffn"
_PREFIX = "tbo-afd/pg"


class AFDPeerError(RuntimeError):
    """The other side of an AFD pair is missing, wrong, or gone; the message names it."""


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, or a ValueError naming ``what`` and the value."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{what} {address!r} is not HOST:PORT (for example 127.0.0.1:29600)")
    return host.strip("[]"), int(port)


class AFDGroup:
    """Point-to-point between the ranks of one AFD pair (attention ranks first, then FFN ranks).

    Create it with `listen` on the FFN side and `connect` on the attention side; `isend`, `irecv` return work
    handles that ``wait(timeout)``, as ``torch.distributed.isend`` / ``irecv`` do.
    """

    def __init__(self, store: Any, rank: int, size: int, backend: str, timeout_s: float, host: str) -> None:
        from torch.distributed import PrefixStore

        self.store, self.rank, self.size, self.backend = store, rank, size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = PrefixStore(_PREFIX, store)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            # two devices, so two connections, each with its own transport thread and lock: one carries the
            # attention side's messages, the other the FFN side's (`isend`). On one connection, a rank's thread
            # that reads an incoming message while its main thread writes an outgoing one waits for that lock by
            # spinning, and on a rank with one core it spins until the scheduler preempts it (measured: stalls of
            # 2 to 4 ms per DBO decode step); apart, neither waits on the other
            options._devices = [ProcessGroupGloo.create_device(hostname=host) for _ in range(2)]  # where told, too
            self.pg = ProcessGroupGloo(prefixed, rank, size, options)
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            raise ValueError(f"AFD transport backend {backend!r}: accepted 'gloo' (CPU) or 'nccl' (CUDA)")

    # ---- meeting -----------------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, address: str, info: dict[str, Any], *, backend: str = "gloo", timeout_s: float = 600.0,
               on_listening: Any = None) -> "AFDGroup":
        """The FFN side (rank 1 of 2): listen on ``address`` (port 0: a free one), publish ``info``, call
        ``on_listening(host, port)``, and wait up to ``timeout_s`` for the attention side to join."""
        from torch.distributed import TCPStore

        host, port = parse_address(address, "--listen")
        store = TCPStore(host, port, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)
        store.set(AFD_INFO_KEY, json.dumps(info))
        if on_listening is not None:
            on_listening(host, store.port)
        try:
            return cls(store, 1, 2, backend, timeout_s, host)
        except RuntimeError as e:
            raise AFDPeerError(f"no attention side joined the FFN server at {host}:{store.port} within "
                               f"{timeout_s:g}s: {str(e).strip().splitlines()[0]}") from None

    @classmethod
    def connect(cls, address: str, *, backend: str = "gloo", connect_timeout_s: float = 10.0,
                timeout_s: float = 60.0, check_info: Any = None) -> "AFDGroup":
        """The attention side (rank 0 of 2): reach the FFN server at ``address``, read what it serves and pass it
        to ``check_info`` (which raises on a mismatch), then join the group."""
        from torch.distributed import TCPStore

        host, port = parse_address(address, "the FFN server address")
        try:
            store = TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=connect_timeout_s))
            raw = store.get(AFD_INFO_KEY)
        except (RuntimeError, OSError) as e:  # torch raises DistStoreError (a RuntimeError) when nobody answers
            raise AFDPeerError(f"no tbo AFD FFN server at {host}:{port} (nothing answered within "
                               f"{connect_timeout_s:g}s: {str(e).strip().splitlines()[0]}); start it first with "
                               f"`tbo afd-ffn --model DIR --listen {host}:{port}`") from None
        info = _parse_info(raw, f"{host}:{port}")
        if check_info is not None:
            check_info(info)
        try:
            return cls(store, 0, 2, backend, max(timeout_s, connect_timeout_s), host)
        except RuntimeError as e:
            raise AFDPeerError(f"the FFN server at {host}:{port} did not join the AFD process group: "
                               f"{str(e).strip().splitlines()[0]}") from None

    # ---- point to point ----------------------------------------------------------------------------------------
    # A message's tag is its sender's rank: gloo runs tag t on device t % 2, so each direction has a connection
    # of its own (see __init__); NCCL ignores tags.
    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return self.pg.send([tensor], dst, self.rank)

    def irecv(self, tensor: torch.Tensor, src: int | None) -> Any:
        """From ``src``, or from any rank when None (the work's ``_source_rank()`` says which)."""
        if src is None:
            return self.pg.recv_anysource([tensor], 1 - self.rank)
        return self.pg.recv([tensor], src, src)

    def close(self) -> None:
        """Leave the group (the store's socket closes with the object)."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:  # already torn down by a lost peer
                pass


def _parse_info(raw: bytes, where: str) -> dict[str, Any]:
    try:
        info = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        info = None
    if not isinstance(info, dict):
        raise AFDPeerError(f"{where} answered, but not as a tbo AFD FFN server (its description is not a JSON "
                           "object)")
    return info
