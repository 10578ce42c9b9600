"""``mooncake.engine`` as Mooncake's binding names it, served by afabric.compat.mooncake."""

from afabric.compat.mooncake import P2PHANDSHAKE, TransferEngine, TransferNotify, TransferOpcode

__all__ = ["P2PHANDSHAKE", "TransferEngine", "TransferNotify", "TransferOpcode"]
