"""A Context used from several threads at once gives the serial results."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import flash_attention_metal as fam

from conftest import make_inputs


def _problems():
    shapes = [(1, 2, 2, 17, 23, 32), (2, 4, 2, 40, 40, 64), (1, 3, 1, 9, 70, 16), (1, 2, 2, 64, 33, 40)]
    return [make_inputs(seed, *shape) for seed, shape in enumerate(shapes * 2)]


def _run(ctx, problem, causal):
    q, k, v, dout = problem
    out, lse = ctx.forward(q, k, v, causal=causal)
    return (out, lse, *ctx.backward(dout, q, k, v, out, lse, causal=causal))


def test_concurrent_calls_match_serial_calls(ctx):
    jobs = [(problem, index % 2 == 0) for index, problem in enumerate(_problems())]
    serial = [_run(ctx, problem, causal) for problem, causal in jobs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(lambda job: _run(ctx, *job), jobs))
    for want, got in zip(serial, concurrent):
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)


def test_gil_is_released_during_native_calls():
    # The CPU engine makes one call long on any machine (about 0.1 s or more), so the main thread
    # can count how often it ran meanwhile; with the GIL held through the call it could not run at
    # all. The binding, not the backend, releases the GIL, so the CPU backend stands for both.
    cpu = fam.Context("cpu")
    q, k, v, _ = make_inputs(0, 1, 4, 4, 1024, 1024, 64)
    ticks = 0
    done = threading.Event()
    worker = threading.Thread(target=lambda: (cpu.forward(q, k, v), done.set()))
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert ticks >= 10, ticks
