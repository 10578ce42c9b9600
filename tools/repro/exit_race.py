"""What /proc says of a SIGKILLed process at the moment its peer sees the socket reset.

A process's sockets close inside its exit (exit_files), before it is a zombie and before
its pidfd turns readable, so a transport can fail operations to it before a pidfd watch
hears of the exit. Counts, over KILLS kills, what /proc/<pid>/stat showed right after
recv() returned: (state, PF_EXITING set, same start time), or ("gone",). Measured on the
2-core development machine, two runs of 200: ('R', True, True) 111 and 46, the rest
('Z', True, True): why the worker's check (shim/procfs.c afs_proc_gone) reads PF_EXITING,
not only 'Z'.
Usage: python tools/repro/exit_race.py [KILLS]"""

import contextlib
import os
import signal
import socket
import subprocess
import sys

CHILD = (
    "import socket, threading, time\n"
    "s = socket.create_connection(('127.0.0.1', {port}))\n"
    "threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n"
    "time.sleep(100)\n"
)


def fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2 :].split()  # state is field 3, flags 9, start time 22


def main(kills: int) -> None:
    seen: dict[tuple[object, ...], int] = {}
    for _ in range(kills):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        child = subprocess.Popen([sys.executable, "-c", CHILD.format(port=srv.getsockname()[1])])
        conn, _ = srv.accept()
        start = fields(child.pid)[19]
        os.kill(child.pid, signal.SIGKILL)
        with contextlib.suppress(ConnectionResetError):
            conn.recv(10)
        try:
            f = fields(child.pid)
            key: tuple[object, ...] = (f[0], bool(int(f[6]) & 0x4), f[19] == start)
        except FileNotFoundError:
            key = ("gone",)
        seen[key] = seen.get(key, 0) + 1
        child.wait()
        conn.close()
        srv.close()
    print(seen)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
