"""Cancelling long calls: Ctrl-C (SIGINT) in the main thread and Context.cancel() from another thread.

These run on the CPU engine, where one call at seqlen 32768 takes tens of seconds and the engine
checks for cancellation between threadgroups and inside them (a Metal call of that size is over before a signal
could reach it). Uncancelled, each call below would run for far longer than the bounds asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import flash_attention_metal as fam

# Serial (conftest.py): the exit bound after SIGINT is a time, not to be shared with other tests.
pytestmark = pytest.mark.serial

LONG_SEQLEN = 32768  # one head, head_dim 64: tens of seconds per call on the CPU engine
# From SIGINT to the child's exit; the cancelled call stops within a few dozen fiber switches
# (well under a second), the rest is slack for a loaded machine.
EXIT_BOUND_SECONDS = 3.0

_CHILD = """
import sys, numpy as np, flash_attention_metal as fam
ctx = fam.Context("cpu")
q = np.random.default_rng(0).standard_normal((1, 1, {n}, 64)).astype(np.float16)
lse = np.zeros((1, 1, {n}), dtype=np.float32)
print("calling", flush=True)
try:
    if sys.argv[1] == "forward":
        ctx.forward(q, q, q)
    else:
        ctx.backward(q, q, q, q, q, lse)
    print("finished", flush=True)
except KeyboardInterrupt:
    ctx.forward(q[:, :, :8], q[:, :, :8], q[:, :, :8])  # the context still works
    print("interrupted", flush=True)
"""


def _interrupt(script: str, *args: str, backend: str | None = None):
    """Runs ``script`` in a child Python, sends it SIGINT once it has printed "calling" and had a
    second to enter the library; returns the child, its stdout and stderr, and the seconds from
    SIGINT to its exit."""
    env = dict(os.environ, **({"FLASH_ATTENTION_METAL_BACKEND": backend} if backend else {}))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(fam.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    # SIGINT back to its default in the child: a parent that ignores it (a shell's background job)
    # would pass that on, and Python then installs no KeyboardInterrupt handler.
    child = subprocess.Popen([sys.executable, "-c", script, *args], env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "calling", child.stderr.read()
        time.sleep(1.0)  # inside the native calls by now
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=120)
        elapsed = time.monotonic() - sent
    finally:
        child.kill()
    return child, stdout, stderr, elapsed


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
@pytest.mark.parametrize("operation", ["forward", "backward"])
def test_ctrl_c_during_a_long_call_raises_keyboard_interrupt_promptly(operation):
    child, stdout, stderr, elapsed = _interrupt(_CHILD.format(n=LONG_SEQLEN), operation)
    assert stdout.strip() == "interrupted", stdout + stderr
    assert child.returncode == 0, stderr
    assert elapsed < EXIT_BOUND_SECONDS, f"the child took {elapsed:.2f} s to stop after SIGINT"


_POOL_CHILD = """
import concurrent.futures, sys, numpy as np, flash_attention_metal as fam
q = np.random.default_rng(0).standard_normal((1, 1, {n}, 64)).astype(np.float16)
pool = concurrent.futures.ThreadPoolExecutor(2)
futures = [pool.submit(fam.forward, q, q, q), pool.submit(fam.Context("cpu").forward, q, q, q)]
print("calling", flush=True)
try:
    with pool:
        [future.result() for future in futures]
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", *(future.exception().status_name for future in futures), flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_cancels_the_calls_of_worker_threads():
    """The ThreadPoolExecutor case: KeyboardInterrupt in the main thread, and each worker's call (on
    the default context and on its own) stopped with FA_STATUS_CANCELLED, so the pool's shutdown
    does not wait for them."""
    _, stdout, stderr, elapsed = _interrupt(_POOL_CHILD.format(n=LONG_SEQLEN), backend="cpu")
    assert stdout.split() == ["interrupted", "FA_STATUS_CANCELLED", "FA_STATUS_CANCELLED"], stdout + stderr
    assert elapsed < EXIT_BOUND_SECONDS, f"the child took {elapsed:.2f} s to stop after SIGINT"


def test_cancel_from_another_thread_stops_the_calls_in_flight():
    ctx = fam.Context("cpu")
    q = np.random.default_rng(1).standard_normal((1, 1, LONG_SEQLEN, 64)).astype(np.float16)
    caught = []

    def long_call():
        try:
            ctx.forward(q, q, q)
        except fam.FlashAttentionError as error:
            caught.append(error)

    worker = threading.Thread(target=long_call)
    started = time.monotonic()
    worker.start()
    # A cancel reaches only calls in flight, so repeat it until the worker's call has started.
    while worker.is_alive():
        ctx.cancel()
        worker.join(0.05)
    assert time.monotonic() - started < EXIT_BOUND_SECONDS
    assert len(caught) == 1 and caught[0].status_name == "FA_STATUS_CANCELLED", caught
    assert "cancelled" in caught[0].message
    # A cancel reaches no later call.
    small = q[:, :, :16]
    out, lse = ctx.forward(small, small, small)
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(out))
