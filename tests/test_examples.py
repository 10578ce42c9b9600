"""Examples run as written, the benchmark runs end to end, and the buffer types the API
promises register and carry data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import afabric

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_two_process_example_runs_as_written(provider: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "two_process.py"), provider],
        check=False,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert "target: 1048576 bytes arrived" in proc.stdout
    assert "initiator: wrote 1048576 bytes" in proc.stdout


async def test_buffer_types_register_and_carry_data() -> None:
    torch = pytest.importorskip("torch")
    async with afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        targets = {
            "numpy": np.zeros(256, dtype=np.float32),
            "bytearray": bytearray(1024),
            "memoryview": memoryview(bytearray(1024)),
            "torch": torch.zeros(256, dtype=torch.float32),
        }
        src = np.arange(256, dtype=np.float32)
        smr = a.register(src)
        for name, buf in targets.items():
            mr = b.register(buf)
            assert mr.length == 1024, name
            imm = b.alloc_imm()
            await a.write(smr, mr.descriptor, 1024, imm=imm)
            await b.expect_imm(imm, 1, timeout=10)
            got = np.frombuffer(bytes(memoryview(buf.numpy() if name == "torch" else buf)), dtype=np.float32)
            assert np.array_equal(got, src), name
        # raw pointers, and the buffers the API refuses
        raw = np.zeros(64, dtype=np.uint8)
        pmr = b.register_ptr(raw.ctypes.data, raw.nbytes, owner=raw)
        await a.write(smr, pmr.descriptor, 64)
        assert raw.any()
        for bad in (b"immutable", np.zeros(8)[::2], np.zeros(0), torch.zeros(4, 4).t(), 42):
            with pytest.raises(afabric.errors.RegistrationError):
                b.register(bad)
