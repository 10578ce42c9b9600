"""Mooncake's import name over afabric: ``mooncake.engine`` is afabric.compat.mooncake."""
