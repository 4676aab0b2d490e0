"""Native calls that Ctrl-C can stop, in the main thread and in any other.

Python runs signal handlers only in the main thread and only between bytecodes, so a SIGINT that
arrives while the main thread is inside a long library call would wait for the call to finish. A
call made from the main thread therefore runs on a worker thread while the main thread waits on an
Event, which signals interrupt on POSIX: a KeyboardInterrupt raised during the wait cancels the
call through the library (``fa_context_cancel``: the CPU engine stops within its current threadgroups,
Metal before its next command buffer), waits for it to stop and propagates.

Calls from other threads (a ``ThreadPoolExecutor``'s) run directly, and signals never interrupt
them; instead, importing the package in the main thread wraps Python's default SIGINT handler:
Ctrl-C then also cancels every library call in flight in any other thread (each raises
FlashAttentionError with status ``FA_STATUS_CANCELLED`` in its thread) and raises KeyboardInterrupt
in the main thread as before. Where another SIGINT handler was installed first (IPython, Jupyter) or
the package was first imported outside the main thread, nothing is wrapped, and a handler installed
later replaces the wrapper: then only main-thread calls are cancelled. With the wrapper in place
``asyncio.run`` keeps Python's plain KeyboardInterrupt instead of installing its own handler.

One worker thread serves the main thread's calls (the main thread makes one at a time); it starts on
first use and again in a forked child, where threads do not survive. The library keeps some state
per thread (the last call's profile), so the main thread reads it through ``call`` too: on the
thread that made its calls.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class _Job:
    """One call for the worker: ``function()``'s result or exception, and when it is done."""

    __slots__ = ("function", "done", "result", "error")

    def __init__(self, function: Callable[[], T]) -> None:
        self.function = function
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.function()
        except BaseException as error:  # handed to the waiting thread, which re-raises it
            self.error = error
        finally:
            self.done.set()


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get().run()


_CANCEL_RETRY_SECONDS = 0.1

_lock = threading.Lock()
_jobs: queue.SimpleQueue | None = None


def _worker_queue() -> queue.SimpleQueue:
    global _jobs
    with _lock:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_jobs,), name="flash_attention_metal calls",
                             daemon=True).start()
        return _jobs


def _forget_worker() -> None:
    global _jobs, _lock
    _jobs = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


def call(function: Callable[[], T], cancel: Optional[Callable[[], None]] = None) -> T:
    """Returns ``function()``, a native call that raises for a failed status itself (the library's
    error message is per thread, so the thread that made the call must read it). In other threads
    the call is cancelled by Ctrl-C where the SIGINT wrapper is installed (see the module docs).

    In the main thread, an exception raised while waiting (KeyboardInterrupt from Ctrl-C, or whatever
    a signal handler raises) calls ``cancel()``, waits for the call to stop and propagates; the
    cancelled call's own outcome (``FA_STATUS_CANCELLED``, outputs NaN) is discarded with it. A
    ``function`` without ``cancel`` (a quick read of per-thread state) is waited for, then the
    exception propagates.
    """
    if threading.current_thread() is not threading.main_thread():
        if cancel is None:
            return function()
        flight = _Flight(cancel)
        with _flights_lock:
            _flights.add(flight)
        try:
            return function()
        finally:
            with _flights_lock:
                _flights.discard(flight)
            flight.landed = True
    job = _Job(function)
    _worker_queue().put(job)
    try:
        job.done.wait()
    except BaseException:
        # Cancel again until the call has stopped: a cancel that lands before the native call has
        # started reaches nothing (the library cancels only calls in flight). Once cancelled, the
        # call stops within microseconds on the CPU engine, within one command buffer on Metal.
        while cancel is not None and not job.done.wait(0):
            cancel()
            job.done.wait(_CANCEL_RETRY_SECONDS)
        job.done.wait()
        raise
    error, result = job.error, job.result
    if error is not None:
        raise error
    return result


class _Flight:
    """A call in flight outside the main thread: how to cancel it, and whether it has returned."""

    __slots__ = ("cancel", "landed")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel
        self.landed = False


_flights_lock = threading.Lock()
_flights: set = set()


def _cancel_until_landed(flights: list) -> None:
    # As in ``call``: a cancel that lands before the native call has started reaches nothing.
    while not all(flight.landed for flight in flights):
        for flight in flights:
            if not flight.landed:
                flight.cancel()
        threading.Event().wait(_CANCEL_RETRY_SECONDS)


def _on_sigint(signum, frame) -> None:
    """Cancels the calls in flight in other threads, then does what Python's default does."""
    with _flights_lock:
        flights = list(_flights)
    if flights:
        threading.Thread(target=_cancel_until_landed, args=(flights,), name="flash_attention_metal cancel",
                         daemon=True).start()
    signal.default_int_handler(signum, frame)


def _wrap_sigint() -> None:
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


_wrap_sigint()
