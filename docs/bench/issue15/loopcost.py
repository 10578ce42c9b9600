"""What one event-loop iteration costs on this machine: a call_soon chain (each iteration a
select(0)), asyncio and uvloop; a no-op ctypes call; time.monotonic."""

import asyncio
import ctypes
import sys
import time

N = 200_000


async def chain() -> float:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [N]

    def tick() -> None:
        left[0] -= 1
        if left[0]:
            loop.call_soon(tick)
        else:
            done.set_result(None)

    t0 = time.perf_counter()
    loop.call_soon(tick)
    await done
    return (time.perf_counter() - t0) / N * 1e6


def main() -> None:
    print(f"LOOP asyncio call_soon iteration {asyncio.run(chain()):.2f} us", flush=True)
    try:
        import uvloop

        print(f"LOOP uvloop call_soon iteration {uvloop.run(chain()):.2f} us", flush=True)
    except ImportError:
        pass
    libc = ctypes.CDLL(None)
    f = libc.getpid
    t0 = time.perf_counter()
    for _ in range(N):
        f()
    print(f"CALL ctypes getpid {(time.perf_counter() - t0) / N * 1e6:.2f} us", flush=True)
    f = libc.abs
    f.argtypes = [ctypes.c_int]
    t0 = time.perf_counter()
    for _ in range(N):
        f(1)
    print(f"CALL ctypes abs {(time.perf_counter() - t0) / N * 1e6:.2f} us", flush=True)
    t0 = time.perf_counter()
    for _ in range(N):
        time.monotonic()
    print(f"CLOCK monotonic {(time.perf_counter() - t0) / N * 1e6:.3f} us", flush=True)


if __name__ == "__main__" and len(sys.argv) == 1:
    main()
