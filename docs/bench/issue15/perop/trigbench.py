"""The triggered write's latency taken apart: `afabric bench trigger` with the writer's
engine made with timing=True, and each triggered write's stamps split into bump -> seen
(the worker, or the watcher thread, saw the word reach its value) and seen -> first post.
Prints the bench's own table, then p50 / p90 / p99 / p99.9 / max µs of the whole and of
both parts, and the parts of the 1% slowest writes (is the tail in seeing or in posting?).
With `numpy`, the bench's writer of before afs_watcher_store: a numpy store into the word
timed from Python, and the clock -> store -> clock it took ("store").
Usage: trigbench.py PROVIDER [ITERATIONS] [numpy]"""

import argparse
import ctypes
import functools
import random
import sys
import time

import numpy as np

from afabric import Engine
from afabric.bench import trigger

SPLITS: list[tuple[int, int, int]] = []  # (whole, bump -> seen, seen -> post) ns
STORES: list[int] = []  # the writer's clock -> store -> clock, ns


def writer(eng, w, n, go, t_change, seed, errs):  # type: ignore[no-untyped-def]
    """trigger._writer as it was (a numpy store timed from Python), with a second clock
    reading after the store."""
    rng = random.Random(seed)
    lo, hi = trigger.PACE_US[0] / 1e6, trigger.PACE_US[1] / 1e6
    clock = time.monotonic_ns
    word = np.ctypeslib.as_array((ctypes.c_uint64 * 1).from_address(w.host_ptr))
    for k in range(n):
        if not go.get():
            return
        time.sleep(rng.uniform(lo, hi))
        t_change[k] = clock()
        word[0] = k + 1
        STORES.append(clock() - t_change[k])


def pct(s: list[int], p: float) -> float:
    s = sorted(s)
    return s[min(len(s) - 1, int(len(s) * p / 100))] / 1e3


def row(name: str, s: list[int]) -> str:
    return f"{name:<12} " + " ".join(f"{pct(s, p):7.2f}" for p in (50, 90, 99, 99.9, 100))


def main() -> None:
    prov = sys.argv[1]
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    trigger.Engine = functools.partial(Engine, timing=True)  # type: ignore[misc]
    orig = trigger._triggered

    async def triggered(eng, mr, desc, imm, n, seed):  # type: ignore[no-untyped-def]
        b = await orig(eng, mr, desc, imm, n, seed)
        stamps = {t.id: t for t in eng.timings()}
        for k, ((op, t_post), t0) in enumerate(zip(b.posts, b.t_change, strict=True)):
            t = stamps.get(op)
            if k >= trigger.WARMUP and t is not None and t.t_pickup:
                SPLITS.append((t_post - t0, t.t_pickup - t0, t_post - t.t_pickup))
        return b

    trigger._triggered = triggered  # type: ignore[assignment]
    if "numpy" in sys.argv[3:]:
        trigger._writer = writer
    args = argparse.Namespace(quick=False, iterations=iters, provider=prov, polling=None, loop="uvloop",
                              json=None, plot=None)  # fmt: skip
    trigger.main(args)
    whole, seen, post = (list(c) for c in zip(*SPLITS, strict=True))
    print(f"{len(SPLITS)} triggered writes, µs: p50 p90 p99 p99.9 max")
    print(row("whole", whole))
    print(row("bump->seen", seen))
    print(row("seen->post", post))
    if STORES:
        print(row("store", STORES))
    cut = sorted(whole)[int(len(whole) * 0.99)]
    tail = [(w, s, p) for w, s, p in SPLITS if w >= cut]
    parts = (f"{w / 1e3:.1f}={s / 1e3:.1f}+{p / 1e3:.1f}" for w, s, p in sorted(tail))
    print("slowest 1%: " + ", ".join(parts))


if __name__ == "__main__":
    main()
