"""A Mooncake TransferEngine target in its own process, for tests/test_compat_mooncake.py.

Usage: ``python mooncake_peer.py METADATA_SERVER BUFFER_BYTES [NAME]``. It initializes an
afabric.compat.mooncake engine (protocol tcp; ``AFABRIC_COMPAT_PROVIDER`` picks another),
allocates a managed buffer, prints ``{"name": ..., "addr": ...}`` as one JSON line, then
answers JSON commands read from stdin, one per line:

- ``{"cmd": "notifies", "count": n, "timeout": s}``: take notifications with get_notifies()
  in a tight loop until n came; each one's message is ``{"off", "len", "sha", "tail"}`` of the
  data its transfer wrote, checked against the buffer the moment the notification is taken:
  its last bytes first (they land last), then the whole. Answers
  ``{"checked": k, "bad": [...], "names": [...]}``.
- ``{"cmd": "exit"}``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
import time

from afabric.compat.mooncake import TransferEngine


def _notifies(te: TransferEngine, addr: int, count: int, timeout: float) -> dict[str, object]:
    bad: list[str] = []
    names: list[str] = []
    checked = 0
    deadline = time.monotonic() + timeout
    while checked < count and time.monotonic() < deadline:
        for note in te.get_notifies():  # a tight poll loop, on purpose
            want = json.loads(note.msg)
            end = addr + want["off"] + want["len"]
            tail = ctypes.string_at(end - len(want["tail"]) // 2, len(want["tail"]) // 2).hex()
            got = hashlib.sha256(ctypes.string_at(addr + want["off"], want["len"])).hexdigest()
            if tail != want["tail"] or got != want["sha"]:
                bad.append(f"{want['off']}+{want['len']}")
            names.append(note.name)
            checked += 1
    return {"checked": checked, "bad": bad, "names": names}


def main() -> int:
    server, size = sys.argv[1], int(sys.argv[2])
    name = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    te = TransferEngine()
    if te.initialize(name, server, "tcp", "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    addr = te.allocate_managed_buffer(size)
    seg = name if server != "P2PHANDSHAKE" else f"127.0.0.1:{te.get_rpc_port()}"
    print(json.dumps({"name": seg, "addr": addr}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "notifies":
            print(json.dumps(_notifies(te, addr, cmd["count"], cmd["timeout"])), flush=True)
        elif cmd["cmd"] == "exit":
            break
    te.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
