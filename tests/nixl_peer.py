"""A NIXL target agent in its own process, for tests/test_compat_nixl.py.

    python tests/nixl_peer.py NAME SIZE

It registers SIZE bytes, prints ``{"md": <metadata hex>, "addr": <address>}``, reads the
initiator's metadata (a line ``{"md": ...}``) and then acts on the initiator's notifications:

- ``W <off> <len> <sha256 hex>``: the bytes a write with this notification put at ``off``
  must already be there: their hash is checked the moment the notification is seen;
- ``P <seq>``: fill the buffer with pattern ``seq`` and answer ``ready <seq>``;
- ``R <seq>``: the initiator's read of pattern ``seq`` is done: overwrite the buffer at once;
- ``END``: print ``{"checked": n, "bad": [...]}`` and exit.

The provider comes from AFABRIC_COMPAT_PROVIDER.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from afabric.compat.nixl import nixl_agent, nixl_agent_config


def pattern(seq: int, size: int) -> np.ndarray:
    return np.random.default_rng(seq).integers(0, 256, size, dtype=np.uint8)


def main() -> None:
    name, size = sys.argv[1], int(sys.argv[2])
    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(size, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    agent.register_memory([(addr, size, 0, "")], "DRAM")
    print(json.dumps({"md": agent.get_agent_metadata().hex(), "addr": addr}), flush=True)
    initiator = agent.add_remote_agent(bytes.fromhex(json.loads(sys.stdin.readline())["md"])).decode()
    checked, bad = 0, []
    while True:
        notes = agent.get_new_notifs().get(initiator, [])
        if not notes:
            time.sleep(0.0005)
            continue
        for msg in notes:
            word = msg.split()
            if word[0] == b"W":
                off, n, want = int(word[1]), int(word[2]), word[3].decode()
                got = hashlib.sha256(buf[off : off + n].tobytes()).hexdigest()
                checked += 1
                if got != want:
                    bad.append(f"write at {off}+{n}: its notification came before its data")
            elif word[0] == b"P":
                buf[:] = pattern(int(word[1]), size)
                agent.send_notif(initiator, b"ready " + word[1])
            elif word[0] == b"R":
                buf[:] = 0xEE
            elif word[0] == b"END":
                print(json.dumps({"checked": checked, "bad": bad}), flush=True)
                agent.close()
                return


if __name__ == "__main__":
    main()
