"""Python cost of submitting one write: ``python -m afabric.bench.submit [provider] [rounds]``.

Times ``eng.write(...)`` from the call to the moment its coroutine suspends on its future
(argument checks, descriptor lookup, the ctypes call that enqueues the request, the
future), against an idle target engine in this process; completions are awaited outside
the timed part. Prints the best of ``rounds`` batches, in µs per submit, for ``write``
and for each write of one ``write_many`` call of the same batch size.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np

from .. import Engine

BATCH = 256
SIZE = 4096


async def _finish(coros: list[Coroutine[Any, Any, None]], futs: list[Any]) -> None:
    await asyncio.gather(*futs)
    for c in coros:
        try:
            c.send(None)
        except StopIteration:
            continue
        raise RuntimeError("write did not finish")


async def main_async(provider: str, rounds: int) -> tuple[float, float]:
    async with Engine(provider) as a, Engine(provider) as b:
        src = np.zeros(SIZE * BATCH, dtype=np.uint8)
        dst = np.zeros(SIZE * BATCH, dtype=np.uint8)
        mr, dmr = a.register(src), b.register(dst)
        desc = dmr.descriptor
        offs = [i * SIZE for i in range(BATCH)]
        clock = time.perf_counter_ns
        best = float("inf")
        for _ in range(rounds):
            coros = [a.write(mr, desc, SIZE, off, off) for off in offs]
            t0 = clock()
            futs = [c.send(None) for c in coros]
            best = min(best, (clock() - t0) / BATCH)
            await _finish(coros, futs)
        best_many = float("inf")
        for _ in range(rounds):
            coro = a.write_many(mr, desc, SIZE, offs, offs)
            t0 = clock()
            fut = coro.send(None)
            best_many = min(best_many, (clock() - t0) / BATCH)
            await _finish([coro], [fut])
        return best / 1e3, best_many / 1e3


def main() -> int:
    provider = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    one, many = asyncio.run(main_async(provider, rounds))
    print(f"{provider}: write submit {one:.2f} µs/op, write_many {many:.3f} µs/op "
          f"(best of {rounds} batches of {BATCH})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
