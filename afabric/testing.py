"""Testing hooks: switches for afabric's own tests (and a provider author's), not API.

They make an engine take code paths the machine it runs on would not, so that CI covers
them; nothing in production should use them, and they are kept out of every public
signature (``Engine(...)`` takes none of them). One switch today:

- :func:`force_efa_modes`: engines created inside the ``with`` ask their provider library
  to behave as it must on EFA where a software provider can pretend to: immediates consume
  posted receives (``FI_RX_CQ_DATA``), local descriptors are required (``FI_MR_LOCAL``) and
  keys are the provider's (``FI_MR_PROV_KEY``). It travels as the shim's
  ``AFS_CFG_FORCE_EFA_MODES`` and the provider ABI's ``AFP_OPEN_FORCE_EFA_MODES`` (both
  marked as testing hooks in their headers); ``tests/test_efa_modes.py`` uses it.

A provider's own testing hooks are environment variables it documents itself (the verbs
provider's ``AFABRIC_VERBS_TEST_DROP_HELLOS``, see ``afabric_verbs``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["efa_modes_forced", "force_efa_modes"]

_FORCE_EFA_MODES: ContextVar[bool] = ContextVar("afabric_force_efa_modes", default=False)


@contextlib.contextmanager
def force_efa_modes(on: bool = True) -> Iterator[None]:
    """Engines created inside (in this thread or asyncio task: a context variable) run
    their provider in EFA's modes; see the module's documentation."""
    token = _FORCE_EFA_MODES.set(bool(on))
    try:
        yield
    finally:
        _FORCE_EFA_MODES.reset(token)


def efa_modes_forced() -> bool:
    """Whether an engine created here and now is to run its provider in EFA's modes."""
    return _FORCE_EFA_MODES.get()
