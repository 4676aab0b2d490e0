"""MPI transport of the ring (mpi4py): non-blocking transfers that progress while a rank computes and
that fail with ``RingTimeoutError`` instead of hanging when a peer stops.

MPI moves a large message only while both ends call into the MPI library; a rank busy in an attention
call does not. With ``MPI.THREAD_MULTIPLE`` (mpi4py's default) a helper thread polls the pending
requests every ``POLL_INTERVAL_S`` while the caller computes, so the next block really is in flight
during the current one (the attention calls release the GIL). At lower thread levels the transfer
progresses only when it is waited for.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

try:
    from mpi4py import MPI
except ImportError as error:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "flash_attention_metal.distributed needs mpi4py and an MPI library: "
        "pip install 'flash_attention_metal[distributed]' (mpi4py with MPICH's wheel), or mpi4py "
        "over a system MPI (e.g. Homebrew's open-mpi)"
    ) from error

#: Seconds a rank waits, after finishing its own work, for a transfer before giving up.
DEFAULT_TIMEOUT_S = 300.0

#: Seconds between two polls of pending requests (progress thread and waits).
POLL_INTERVAL_S = 0.0005


class RingTimeoutError(TimeoutError):
    """A transfer with another rank did not complete in time: that rank failed, stopped or is far
    behind. The communicator is left with pending operations; end the job (``comm.Abort()``)."""


def check_comm(comm) -> None:
    """``comm`` must be an mpi4py intracommunicator other than ``MPI.COMM_NULL``."""
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(
            f"comm must be an mpi4py intracommunicator such as MPI.COMM_WORLD, got {type(comm).__name__}"
        )


def check_timeout(timeout) -> float:
    """``timeout`` must be a positive, finite number of seconds; returns it as a float."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not 0 < float(timeout) < float("inf"):
        raise ValueError(f"timeout must be positive and finite (seconds), got {timeout}")
    return float(timeout)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A contiguous array's memory as uint8, the form every transfer uses (any dtype, bfloat16
    included, travels as raw bytes)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class Transfer:
    """Pending MPI requests of one operation (``what``, named in errors)."""

    def __init__(self, comm, requests: Sequence, what: str) -> None:
        self._rank = comm.Get_rank()
        self._requests = list(requests)
        self._what = what
        self._posted = time.perf_counter()
        self._done_at: float | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self._poller = threading.Thread(target=self._progress, name="ring-progress", daemon=True)
            self._poller.start()

    def _test(self) -> bool:
        if self._done_at is None and MPI.Request.Testall(self._requests):
            self._done_at = time.perf_counter()
        return self._done_at is not None

    def _progress(self) -> None:
        try:
            while not self._stop.is_set() and not self._test():
                time.sleep(POLL_INTERVAL_S)
        except BaseException as error:  # re-raised by wait() on the caller's thread
            self._error = error

    def wait(self, timeout: float) -> float:
        """Waits until every request completed; returns the seconds spent waiting.

        Raises RingTimeoutError when they are not complete ``timeout`` seconds after the call
        (pending receives are cancelled; the job should then be aborted).
        """
        start = time.perf_counter()
        if self._poller is not None:
            self._stop.set()
            self._poller.join()
        if self._error is not None:
            raise self._error
        while not self._test():
            if time.perf_counter() - start > timeout:
                self._cancel()
                raise RingTimeoutError(
                    f"rank {self._rank}: {self._what} did not complete within {timeout:g} s: a rank "
                    "failed, stopped or is far behind; end the job with comm.Abort()"
                )
            time.sleep(POLL_INTERVAL_S)
        return time.perf_counter() - start

    @property
    def seconds_in_flight(self) -> float:
        """Seconds from posting to completion (as seen by the polls); valid after ``wait``."""
        return (self._done_at or self._posted) - self._posted

    def _cancel(self) -> None:
        for request in self._requests:
            if request != MPI.REQUEST_NULL:
                try:
                    request.Cancel()
                except MPI.Exception:
                    pass  # a request MPI cannot cancel stays pending; the job is to be aborted


def shift(comm, send: np.ndarray | None, receive: np.ndarray | None, tag: int, what: str) -> Transfer:
    """Starts sending ``send`` to the next rank of the ring and receiving ``receive`` from the
    previous one (either may be None); both are contiguous arrays sent as raw bytes."""
    rank, size = comm.Get_rank(), comm.Get_size()
    previous, following = (rank - 1) % size, (rank + 1) % size
    requests, peers = [], []
    if receive is not None:
        requests.append(comm.Irecv([as_bytes(receive), MPI.BYTE], source=previous, tag=tag))
        peers.append(f"from rank {previous}")
    if send is not None:
        requests.append(comm.Isend([as_bytes(send), MPI.BYTE], dest=following, tag=tag))
        peers.append(f"to rank {following}")
    return Transfer(comm, requests, f"{what} ({', '.join(peers)})")


def allgather_ints(comm, values: Sequence[int], *, timeout: float, what: str) -> np.ndarray:
    """Every rank's ``values`` (same count on every rank): int64 array (world_size, len(values))."""
    send = np.asarray(values, dtype=np.int64)
    receive = np.empty((comm.Get_size(), send.size), dtype=np.int64)
    Transfer(comm, [comm.Iallgather([send, MPI.INT64_T], [receive, MPI.INT64_T])], what).wait(timeout)
    return receive


def allgather_bytes(comm, send: np.ndarray, counts: Sequence[int], *, timeout: float, what: str) -> np.ndarray:
    """Concatenation over ranks of each rank's bytes of ``send`` (rank i sends ``counts[i]`` bytes)."""
    counts = np.asarray(counts, dtype=np.int64)
    displacements = np.concatenate(([0], np.cumsum(counts)[:-1]))
    receive = np.empty(int(counts.sum()), dtype=np.uint8)
    request = comm.Iallgatherv([as_bytes(send), MPI.BYTE], [receive, (counts, displacements), MPI.BYTE])
    Transfer(comm, [request], what).wait(timeout)
    return receive
