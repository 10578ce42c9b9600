"""An engine's address says whose it is: ``repr(Address)`` names the provider, the process,
its host and the engine's incarnation, so a log can tell peers apart (before, every
address printed as the same 16 hex digits of the blob's fixed header)."""

from __future__ import annotations

import os
import pickle

import afabric

from .procs import Ctl, Peer


async def address_of(ctl: Ctl, provider: str) -> bool:
    async with afabric.Engine(provider) as eng:
        ctl.put(bytes(eng.address))
        await ctl.get()
        return True


async def test_repr_tells_engines_apart(provider: str, peers: list[Peer]) -> None:
    other = Peer(address_of, provider)
    peers.append(other)
    theirs = afabric.Address.from_bytes(await other.get())
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        mine = [a.address, b.address]
        texts = [repr(x) for x in (*mine, theirs)]
        assert len(set(texts)) == 3, texts
        for addr, pid in ((mine[0], os.getpid()), (mine[1], os.getpid()), (theirs, other.proc.pid)):
            text = repr(addr)
            assert text.startswith(f"Address({provider}, pid {pid} on host "), text
            assert f"incarnation {addr.incarnation:016x}" in text and text.endswith("nics=1)"), text
            assert addr.provider == provider and addr.pid == pid, text
        assert mine[0].host == mine[1].host == theirs.host  # one host
        assert repr(pickle.loads(pickle.dumps(theirs))) == repr(theirs)
    other.put("stop")
    assert await other.result() is True
