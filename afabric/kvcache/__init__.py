"""Disaggregated-inference KV-cache transfer: a decoder's paged cache filled layer by layer
by prefillers, while the next layer is still computing.

:class:`Decoder` owns the paged cache and asks; :class:`Prefiller` computes and writes,
each layer's paged writes armed on a watcher that the model bumps (see the modules'
docstrings for the protocol: :mod:`.wire`, cancellation and liveness in :mod:`.decoder`
and :mod:`.prefiller`). Per request the decoder may instead *pull* (``submit(...,
mode="pull")``): the prefiller holds the computed pages and the decoder reads them.
"""

from .allocator import PageAllocator
from .decoder import Decoder, DecodeRequest, State
from .errors import CacheFull, ProtocolError, RequestCancelled, RequestFailed, RequestRejected
from .layout import KvCacheLayout
from .prefiller import JobState, Prefiller, PrefillJob

__all__ = [
    "CacheFull",
    "DecodeRequest",
    "Decoder",
    "JobState",
    "KvCacheLayout",
    "PageAllocator",
    "PrefillJob",
    "Prefiller",
    "ProtocolError",
    "RequestCancelled",
    "RequestFailed",
    "RequestRejected",
    "State",
]
