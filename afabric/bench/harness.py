"""What every ``afabric`` benchmark command shares, so that each behaves the same way:

- optional dependencies (torch, cupy, matplotlib, uvloop) checked up front:
  :func:`require` raises :class:`MissingDependency` naming the package to install (the CLI
  exits 2 with it) before anything is started;
- output paths (``--json``, ``--plot``) checked before a benchmark runs
  (:func:`check_outputs`), and ``--json -`` meaning standard output (:func:`write_json`;
  the CLI then sends the human-readable report to standard error);
- one set of defaults: the event loop (:func:`default_loop`) and ``--provider auto``
  resolved once, in the parent, the way ``Engine(provider="auto")`` resolves it
  (:func:`resolve_provider`), the result handed to every child process;
- child processes (:class:`Child`) whose death fails the parent at once with the child's
  own error (:class:`ChildFailed`), instead of a parent waiting on a pipe nobody will write.

Nothing heavy is imported here: the CLI imports this module on every call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import IO, Any

from ..errors import AfabricError

__all__ = [
    "INSTALL",
    "JSON_HELP",
    "LOOP_HELP",
    "PIPE",
    "PROVIDER_HELP",
    "Child",
    "ChildFailed",
    "CommandError",
    "MissingDependency",
    "check_outputs",
    "default_loop",
    "require",
    "resolve_provider",
    "watch",
    "write_json",
]

# What to install for each optional package (the name a user types, not the module's).
INSTALL: Mapping[str, str] = {
    "torch": "pip install torch (CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)",
    "cupy": "pip install cupy-cuda12x (the wheel matching your CUDA)",
    "matplotlib": "pip install 'afabric[plot]'",
    "uvloop": "pip install 'afabric[uvloop]'",
}


PROVIDER_HELP = (
    "provider name, or 'auto' (the default): what Engine(provider='auto') picks here, "
    "resolved once for every process of the run and printed with the results"
)
LOOP_HELP = "event loop (default: uvloop if installed, else asyncio)"
JSON_HELP = "also write the results as JSON to PATH ('-': to stdout, and the report to stderr)"
PLOT_HELP = "also draw the results as a PNG plot to PATH (needs matplotlib: pip install 'afabric[plot]')"

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"64KiB"``, ``"1M"``, ``"2G"`` -> bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 4K, 1M, 1G)")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]


def size_list(text: str) -> list[int]:
    """``"8,4K,1M"`` -> sizes in bytes, each at least 1 (an argparse type)."""
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be at least 1 byte: {text!r}")
    return sizes


def _int_at_least(lowest: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be at least {lowest}: {text!r}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (an argparse type: repeats, iterations, processes)."""
    return _int_at_least(1, text)


def nonnegative_int(text: str) -> int:
    """A whole number >= 0 (an argparse type: where 0 means "none" or "the default")."""
    return _int_at_least(0, text)


def count_list(text: str) -> list[int]:
    """``"8,16"`` -> positive counts (an argparse type)."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts: {text!r} (e.g. 8,16)") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"not a list of positive counts: {text!r} (e.g. 8,16)")
    return counts


def provider_name(text: str) -> str:
    """``--provider``: ``auto`` or the name of an installed provider (an argparse type, so a
    typo is a usage error of the subcommand, exit status 2). Reads installed metadata only;
    whether the provider is usable here is checked before the run (:func:`check_provider`)."""
    from .. import registry

    if text == "auto":
        return text
    names = registry.names()
    if text not in names:
        raise argparse.ArgumentTypeError(
            f"no provider {text!r} is installed (installed: {', '.join(names) or 'none'}; or auto)"
        )
    return text


def check_provider(ns: argparse.Namespace) -> None:
    """Before a benchmark runs: raise :class:`CommandError` if the provider named with
    ``--provider`` cannot be used on this machine (saying why)."""
    from .. import registry

    name = getattr(ns, "provider", None)
    if not name or name == "auto":
        return
    a = registry.probe(name)
    if not a.available:
        raise CommandError(f"--provider {name}: unavailable here: {a.reason}")


def add_run_arguments(p: argparse.ArgumentParser, quick: str) -> None:
    """The options every measuring benchmark takes: provider, outputs, a smoke-run switch."""
    p.add_argument("--provider", default="auto", type=provider_name, help=PROVIDER_HELP)
    p.add_argument("--json", metavar="PATH", default=None, help=JSON_HELP)
    p.add_argument("--plot", metavar="PATH", default=None, help=PLOT_HELP)
    p.add_argument("--quick", action="store_true", help=quick)


def add_loop_arguments(p: argparse.ArgumentParser, who: str) -> None:
    """How the measuring process runs: its workers' polling and its event loop."""
    p.add_argument("--polling", choices=("adaptive", "spin"), default=None,
                   help=f"{who} polling: adaptive (default; spin briefly, then sleep) "
                        "or spin (a core per worker)")  # fmt: skip
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default=default_loop(), help=LOOP_HELP)


class CommandError(AfabricError):
    """A command cannot run as asked (bad option, missing package, unusable output path):
    reported before anything starts; the CLI exits with status 2."""

    exit_status = 2


class MissingDependency(CommandError, ImportError):
    """An optional package the command needs cannot be imported."""


class ChildFailed(AfabricError):
    """A benchmark's child process died (or exited early); the message carries its error."""


# ---- optional dependencies ----


def require(command: str, *modules: str) -> None:
    """Raise :class:`MissingDependency` unless every module in ``modules`` imports.

    The import is real (not only a search for the package), so a broken install counts as
    missing, and it happens here, up front, not in a child process minutes later."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a package that fails while loading (CUDA libraries)
            how = INSTALL.get(name, f"pip install {name}")
            raise MissingDependency(
                f"{command} needs {name}, which cannot be imported here "
                f"({type(e).__name__}: {e}); install it: {how}"
            ) from e


# ---- defaults ----


def default_loop() -> str:
    """The event loop every benchmark uses unless ``--loop`` says otherwise: uvloop when it
    is installed, else asyncio's own."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def resolve_provider(requested: str | None) -> tuple[str, str]:
    """``(provider name, sentence saying why)`` for ``--provider`` (None or ``"auto"``: a
    default engine, which routes per peer, unless ``$AFABRIC_PROVIDER`` names one).
    Resolved once, in the parent, so that every process of a benchmark uses the same one."""
    from .. import registry

    if (requested or "auto") == "auto" and registry.env_provider() is None:
        return "auto", registry.routes()[1]
    spec, why = registry.resolve(requested or "auto")
    return spec.name, why


# ---- outputs ----


def _path_problem(option: str, value: str) -> str | None:
    path = Path(value)
    if path.is_dir():
        return f"{option} {value}: is a directory"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"{option} {value}: the directory {parent} does not exist"
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"{option} {value}: not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"{option} {value}: cannot create files in {parent}"
    return None


def check_outputs(ns: argparse.Namespace, command: str = "afabric bench") -> None:
    """Before a benchmark runs: raise :class:`CommandError` for an output path it could not
    write at the end (``--json``, ``--plot``; ``--json -`` is standard output), and
    :class:`MissingDependency` for a ``--plot`` without matplotlib."""
    json_path = getattr(ns, "json", None)
    if json_path and json_path != "-":
        problem = _path_problem("--json", json_path)
        if problem:
            raise CommandError(problem)
    plot = getattr(ns, "plot", None)
    if plot:
        if plot == "-":
            raise CommandError("--plot writes a PNG file: give a path, not '-'")
        problem = _path_problem("--plot", plot)
        if problem:
            raise CommandError(problem)
        require(f"{command} --plot", "matplotlib")


def write_json(doc: Any, ns: argparse.Namespace) -> None:
    """Write ``doc`` as JSON to ``ns.json``: a file, or standard output for ``-`` (the
    stream the CLI kept for it in ``ns.json_stream``, where the report goes to stderr)."""
    path = getattr(ns, "json", None)
    if not path:
        return
    if path == "-":
        stream: IO[str] = getattr(ns, "json_stream", None) or sys.stdout
        json.dump(doc, stream, indent=1)
        stream.write("\n")
        stream.flush()
        return
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


# ---- child processes ----

PIPE = object()  # stands for the child's end of its pipe in Child's argument list


def _child_main(err: Connection, target: Callable[..., object], args: Sequence[Any]) -> None:
    """Runs in the child: the target, and on failure its error sent to the parent first.
    SIGINT, SIGTERM and SIGHUP (Ctrl-C and ``timeout`` signal the whole process group)
    stop it as they stop the command (:mod:`.interrupt`): its engines closed, then a quiet
    exit with 128 + the signal's number, no traceback (the command prints the one line)."""
    from . import interrupt

    with interrupt.handled():
        try:
            target(*args)
        except BaseException as e:
            signum = interrupt.received()
            if signum is None and isinstance(e, KeyboardInterrupt):
                signum = signal.SIGINT
            if signum is not None:
                err.close()
                sys.exit(interrupt.exit_status(signum))
            with contextlib.suppress(Exception):
                err.send(f"{type(e).__name__}: {e}")
            raise
        finally:
            err.close()


class Child:
    """A spawned benchmark process with a duplex pipe (``conn``) to it.

    ``args`` are the target's arguments, :data:`PIPE` standing for the child's end of the
    pipe. The parent closes its copy of that end, so a read on ``conn`` ends (``EOFError``)
    when the child dies; :meth:`recv` waits for a message or the child's death, whichever
    comes first; :func:`watch` fails an ``async with`` body the moment a child dies. Call
    :meth:`stop` (or set ``stopping``) before a child is expected to exit."""

    def __init__(
        self, name: str, target: Callable[..., object], args: Sequence[Any], daemon: bool = True
    ) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_end = ctx.Pipe()
        self._err, err_w = ctx.Pipe(duplex=False)
        real = tuple(child_end if a is PIPE else a for a in args)
        self.proc = ctx.Process(target=_child_main, args=(err_w, target, real), daemon=daemon)
        self.stopping = False
        self._error: str | None = None
        self._failure: str | None = None
        self._lock = threading.Lock()
        self.proc.start()
        child_end.close()
        err_w.close()

    @property
    def sentinel(self) -> int:
        return int(self.proc.sentinel)

    def error(self) -> str | None:
        """The child's own error (``Type: message``), if it sent one before dying."""
        if self._error is None:
            with contextlib.suppress(EOFError, OSError):
                if self._err.poll(0.2):
                    self._error = str(self._err.recv())
        return self._error

    def failure(self) -> str:
        """Why the child is gone, as one sentence for the user (worked out once: the loop's
        watcher and a thread reading the pipe may both ask)."""
        with self._lock:
            if self._failure is None:
                self._failure = self._describe()
            return self._failure

    def _describe(self) -> str:
        self.proc.join(2.0)
        code = self.proc.exitcode
        if code is None:
            status = "stopped answering" if self.proc.is_alive() else "exited"
        elif code < 0:
            try:
                status = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                status = f"was killed by signal {-code}"
        else:
            status = f"exited with status {code}"
        err = self.error()
        where = f"{self.name} (pid {self.proc.pid}) {status}"
        if err:
            return f"{where}: {err}"
        return f"{where} before it finished (its own output, if any, is above on stderr)"

    def recv(self, timeout: float | None = None) -> Any:
        """The next message from the child; :class:`ChildFailed` at once if it dies first,
        or if ``timeout`` seconds pass without one."""
        ready = wait([self.conn, self.proc.sentinel], timeout)
        if self.conn in ready:
            try:
                return self.conn.recv()
            except EOFError:
                raise ChildFailed(self.failure()) from None
        if ready:
            raise ChildFailed(self.failure())
        raise ChildFailed(f"{self.name} (pid {self.proc.pid}) sent nothing in {timeout:g} s")

    async def arecv(self, timeout: float | None = None) -> Any:
        """:meth:`recv` without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, self.recv, timeout)

    def send(self, obj: Any) -> None:
        self.conn.send(obj)

    def stop(self, message: Any = "stop") -> None:
        """Tell the child to finish (its exit is expected from now on)."""
        self.stopping = True
        with contextlib.suppress(OSError):
            self.conn.send(message)

    def close(self, timeout: float = 30.0) -> None:
        """Wait up to ``timeout`` s for the child to exit, then kill it."""
        self.stopping = True
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self._err.close()


GRACE_S = 1.0  # after a failure in a watched block: how long a child's exit may lag behind it


def _dead(children: Sequence[Child], grace: float) -> Child | None:
    """A child not told to stop that has exited, or exits within ``grace`` seconds."""
    live = [c for c in children if not c.stopping]
    if not live:
        return None
    ready = wait([c.sentinel for c in live], grace)
    return next((c for c in live if c.sentinel in ready), None)


def _uncancel(task: asyncio.Task[Any]) -> None:
    uncancel = getattr(task, "uncancel", None)  # Python 3.11+
    if uncancel is not None:
        uncancel()


@contextlib.asynccontextmanager
async def watch(*children: Child) -> AsyncIterator[None]:
    """Within this block, a child that exits without having been told to stop cancels the
    block at once and :class:`ChildFailed` is raised with the child's error (the block may be
    waiting on anything: a pipe, a transfer to the dead process, a timer)."""
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    if current is None:
        raise RuntimeError("watch() needs a task")
    task: asyncio.Task[Any] = current
    died: list[Child] = []

    def gone(c: Child) -> None:
        loop.remove_reader(c.sentinel)
        if not c.stopping and not died:
            died.append(c)
            task.cancel()

    for c in children:
        loop.add_reader(c.sentinel, gone, c)
    try:
        yield
    except BaseException as e:
        if not died and not isinstance(e, (asyncio.CancelledError, KeyboardInterrupt)):
            # A transfer to a process that just died may fail before its exit is seen here:
            # the death is the cause worth reporting (the transfer's error is chained).
            dead = _dead(children, GRACE_S)
            if dead is not None:
                raise ChildFailed(dead.failure()) from e
        if not died:
            raise
        _uncancel(task)
        raise ChildFailed(died[0].failure()) from (None if isinstance(e, asyncio.CancelledError) else e)
    finally:
        for c in children:
            with contextlib.suppress(Exception):
                loop.remove_reader(c.sentinel)
    if died:  # it died as the block was finishing: take back the cancellation, then fail
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        _uncancel(task)
        raise ChildFailed(died[0].failure())
