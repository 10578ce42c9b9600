"""The Python floor under afabric's per-operation cost: the same asyncio and ctypes steps an
awaited write takes, with no transport behind them, beside afabric's own numbers in one run.

- ``lanes``: 64 coroutines each awaiting writes one after another (perop.py's pattern). Each
  write is a coroutine that makes one ctypes call (three pointer arguments, as afabric's
  submit), makes a future, files it in a dict and awaits it; one callback per loop turn
  resolves every future filed since (afabric's drain, as a list of ids). Prints the loop
  thread's CPU time per write, min and median of 7 runs of 60,000 writes.
- ``alone``: one coroutine awaiting a write whose completion is found in the call itself
  (afabric's take path): a coroutine, one ctypes call with four arguments, no future. Prints
  the time per awaited call, median of 7 runs of 200,000.

Usage: floor.py (uvloop, as `afabric bench` runs)."""

import asyncio
import ctypes
import statistics
import time
from typing import Any

import uvloop

from afabric import _native

# afs_abi_version takes no arguments: extra ones are ignored on x86-64 and aarch64 (caller
# cleans up), so it stands for a shim entry point of this signature at no cost of its own.
_LIB = ctypes.CDLL(_native.shim().path, mode=ctypes.RTLD_LOCAL)
_SUBMIT = _LIB["afs_abi_version"]
_SUBMIT.restype = ctypes.c_int32
_SUBMIT.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_TAKE = _LIB["afs_abi_version"]  # a second function object (lib[name] makes one): its own argtypes
_TAKE.restype = ctypes.c_int32
_TAKE.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32]


class Model:
    """The least an asyncio API with one future per operation does per write."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.ops: dict[int, tuple[asyncio.Future[None], str, int, tuple[Any, ...], str]] = {}
        self.done: list[int] = []
        self.next = 0
        self.armed = False
        self.h, self.req, self.out = (ctypes.c_void_p(n) for n in (1, 2, 3))

    async def write(self, mr: Any, desc: Any, length: int) -> None:
        _SUBMIT(self.h, self.req, self.out)
        op, self.next = self.next, self.next + 1
        fut: asyncio.Future[None] = self.loop.create_future()
        self.ops[op] = (fut, "write", 0, (mr,), "write")
        self.done.append(op)  # "completes" at once: the drain below finds it
        if not self.armed:
            self.armed = True
            self.loop.call_soon(self.drain)
        await fut

    def drain(self) -> None:
        self.armed = False
        ids, self.done = self.done, []
        pop = self.ops.pop
        for op in ids:
            fut = pop(op)[0]
            if not fut.done():
                fut.set_result(None)

    async def taken(self, mr: Any, desc: Any, length: int) -> None:
        _TAKE(self.h, self.req, self.out, 50_000)


async def lanes(m: Model, n: int, width: int) -> float:
    per = n // width

    async def lane() -> None:
        w = m.write
        for _ in range(per):
            await w(None, None, 8)

    c0 = time.thread_time()
    await asyncio.gather(*(lane() for _ in range(width)))
    return (time.thread_time() - c0) / (per * width) * 1e6


async def alone(m: Model, n: int) -> float:
    w = m.taken
    t0 = time.perf_counter()
    for _ in range(n):
        await w(None, None, 8)
    return (time.perf_counter() - t0) / n * 1e6


async def main() -> None:
    m = Model()
    await lanes(m, 20000, 64)
    cpu = sorted([await lanes(m, 60000, 64) for _ in range(7)])
    print(f"FLOOR lanes loop thread cpu us/op min {cpu[0]:.2f} med {cpu[3]:.2f}", flush=True)
    per = [await alone(m, 200_000) for _ in range(7)]
    print(f"FLOOR alone us per awaited call med {statistics.median(per):.2f} min {min(per):.2f}", flush=True)


if __name__ == "__main__":
    uvloop.run(main())
