"""``nixl.logging``: NIXL's logger hierarchy (``nixl.<module>``), level from ``NIXL_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os
import threading

_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
_once = threading.Lock()
_configured = False


def setup_logging() -> None:
    """Give the ``nixl`` logger a console handler (once), as upstream does."""
    global _configured
    with _once:
        if _configured:
            return
        root = logging.getLogger("nixl")
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s")
        )
        root.addHandler(handler)
        root.propagate = False
        root.setLevel(logging.INFO)
        wanted = os.environ.get("NIXL_LOG_LEVEL", "").upper()
        if wanted in _LEVELS:
            root.setLevel(_LEVELS[wanted])
        elif wanted:
            root.warning("Invalid NIXL_LOG_LEVEL value %r: using INFO", wanted)
        _configured = True


def get_logger(name: str) -> logging.Logger:
    """The logger ``nixl.<name>`` (leading underscores dropped: ``_api`` -> ``nixl.api``)."""
    setup_logging()
    return logging.getLogger(f"nixl.{name.lstrip('_')}")
