"""NIXL (UCX backend) between two processes on one host, the same pattern as `afabric bench
p2p --pattern fixed`: W writes of one size in flight, each from and to offset 0 of a buffer
of its size, reposted as soon as it completes; and one 8 B write at a time, awaited by
polling its state. Run with a Python that has NIXL (`pip install nixl-cu12`); UCX_TLS picks
UCX's transports (cma: the writer's own process_vm_writev; tcp).
Usage: python tools/nixl/nixl_bw.py [--sizes 4K,64K,1M,16M] [--seconds 1.0]; NIXL_HUGEPAGES=1: both buffers
2 MiB-aligned and advised for huge pages (afabric's `bench p2p --hugepages`)."""

import argparse
import mmap
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

REGION = 64 << 20


def _size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def region(fill: int) -> np.ndarray:
    """The buffer: np.zeros / np.full as before, or with NIXL_HUGEPAGES=1 what
    afabric.host_buffer gives (2 MiB-aligned, madvise(MADV_HUGEPAGE) before first touch;
    written out here: this Python need not have afabric), as `bench p2p --hugepages` uses."""
    if os.environ.get("NIXL_HUGEPAGES") != "1":
        return np.zeros(REGION, dtype=np.uint8) if fill == 0 else np.full(REGION, fill, dtype=np.uint8)
    huge = 2 << 20
    mm = mmap.mmap(-1, REGION + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)
    skip = -whole.ctypes.data % huge
    mm.madvise(mmap.MADV_HUGEPAGE, skip, REGION)
    buf = whole[skip : skip + REGION]
    buf[:] = fill
    return buf


def target(conn: Any) -> None:
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = region(0)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, REGION, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.recv()  # "done": the initiator has finished; then check what landed
    conn.send(int(buf[:16].sum()))


def _request(agent: Any, remote: str, laddr: int, raddr: int, size: int, per: int) -> Any:
    """One WRITE request of `per` writes of `size` bytes, each from and to offset 0."""
    return agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(laddr, size, 0)] * per, "DRAM"),
        agent.get_xfer_descs([(raddr, size, 0)] * per, "DRAM"),
        remote,
    )


def rate(agent: Any, remote: str, laddr: int, raddr: int, size: int, window: int, seconds: float,
         per: int = 1) -> float:
    """Writes per second with `window` requests of `per` writes each in flight for about
    `seconds` (per > 1: NIXL's batch form, one request of many descriptors, as afabric's
    write_many), each reposted as soon as it is DONE."""
    hs = [_request(agent, remote, laddr, raddr, size, per) for _ in range(window)]
    done = 0
    t0 = time.perf_counter()
    for h in hs:
        agent.transfer(h)
    while True:
        for h in hs:
            st = agent.check_xfer_state(h)
            if st == "DONE":
                done += per
                agent.transfer(h)
            elif st == "ERR":
                raise RuntimeError("NIXL transfer failed")
        if done and time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    for h in hs:  # let the last ones finish before releasing them
        while agent.check_xfer_state(h) == "PROC":
            pass
        agent.release_xfer_handle(h)
    return done / elapsed


def latency(agent: Any, remote: str, laddr: int, raddr: int, n: int) -> list[float]:
    h = _request(agent, remote, laddr, raddr, 8, 1)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        agent.transfer(h)
        while (st := agent.check_xfer_state(h)) == "PROC":
            pass
        if st != "DONE":
            raise RuntimeError("NIXL transfer failed")
        out.append((time.perf_counter() - t0) * 1e6)
    agent.release_xfer_handle(h)
    return out


def report(label: str, size: int, rates: list[float]) -> None:
    gbs = sorted(r * size / 1e9 for r in rates)
    mid = len(gbs) // 2
    print(f"NIXL {label}: {gbs[mid]:7.2f} GB/s (median of {len(gbs)}; {gbs[0]:.2f}-{gbs[-1]:.2f}), "
          f"{sorted(rates)[mid]:,.0f} op/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b,), daemon=True)
    p.start()
    while not a.poll(0.5):  # a target that failed (e.g. its UCX backend) must not hang us
        if not p.is_alive():
            sys.exit(f"NIXL's target process exited (code {p.exitcode}) before it was ready")
    meta, raddr = a.recv()
    agent = nixl_agent("init", nixl_agent_config(backends=["UCX"]))
    buf = region(1)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, REGION, 0, "")], "DRAM"))
    remote = agent.add_remote_agent(meta)
    laddr = buf.ctypes.data
    while not agent.check_remote_metadata(remote):
        time.sleep(0.01)
    for s in args.sizes.split(","):
        size = _size(s)
        window = 64 if size < (1 << 20) else 16
        rates = [rate(agent, remote, laddr, raddr, size, window, args.seconds) for _ in range(args.repeat)]
        report(f"write {s:>4} win {window:2d}", size, rates)
        if size <= (64 << 10):  # 4 requests of 64 writes in flight
            rates = [rate(agent, remote, laddr, raddr, size, 4, args.seconds, per=64)
                     for _ in range(args.repeat)]
            report(f"many  {s:>4} 4x64  ", size, rates)
    lat = sorted(latency(agent, remote, laddr, raddr, 2000)[100:])
    print(f"NIXL awaited 8 B write, one at a time: p50 {lat[len(lat) // 2]:.2f} us, "
          f"p99 {lat[int(len(lat) * 0.99)]:.2f} us ({len(lat)} samples)", flush=True)
    a.send("done")
    landed = a.recv()
    print(f"NIXL target saw its first 16 bytes sum to {landed} (16 expected: the writes landed)")
    p.join(10)
    sys.stdout.flush()
    os._exit(0)  # NIXL 1.5.1's teardown at interpreter exit segfaulted here (after the results)


if __name__ == "__main__":
    main()
