"""Native calls that Ctrl-C can stop.

Python runs signal handlers only in the main thread and only between bytecodes, so a SIGINT that
arrives while the main thread is inside a long library call would wait for the call to finish. A
call made from the main thread therefore runs on a worker thread while the main thread waits on an
Event, which signals interrupt on POSIX: a KeyboardInterrupt raised during the wait cancels the
call through the library (``fa_context_cancel``: the CPU engine stops within its current threadgroups,
Metal before its next command buffer), waits for it to stop and propagates. Calls from other
threads run directly: signals never interrupt them.

One worker thread serves the main thread's calls (the main thread makes one at a time); it starts on
first use and again in a forked child, where threads do not survive. The library keeps some state
per thread (the last call's profile), so the main thread reads it through ``call`` too: on the
thread that made its calls.
"""

from __future__ import annotations

import os
import queue
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
    error message is per thread, so the thread that made the call must read it).

    In the main thread, an exception raised while waiting (KeyboardInterrupt from Ctrl-C, or whatever
    a signal handler raises) calls ``cancel()``, waits for the call to stop and propagates; the
    cancelled call's own outcome (``FA_STATUS_CANCELLED``, outputs NaN) is discarded with it. A
    ``function`` without ``cancel`` (a quick read of per-thread state) is waited for, then the
    exception propagates.
    """
    if threading.current_thread() is not threading.main_thread():
        return function()
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
