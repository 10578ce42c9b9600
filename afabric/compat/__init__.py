"""Serving frameworks' transfer APIs over afabric: :mod:`afabric.compat.mooncake` (Mooncake's
``TransferEngine``) and NIXL's ``nixl_agent``.

Both are blocking, thread-safe APIs; they share one private event-loop thread per process
(:mod:`afabric.compat._core`). Importing this package, or a layer, loads no library and starts
no thread: the thread starts with the first agent.
"""
