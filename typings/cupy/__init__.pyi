# The parts of CuPy that afabric uses (afabric.moe): enough for mypy --strict.
from typing import Any

from . import cuda as cuda

class _Function:
    ptr: int

class RawKernel:
    @property
    def kernel(self) -> _Function: ...
    def __call__(
        self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], *, shared_mem: int = ...
    ) -> None: ...

class RawModule:
    def __init__(
        self, *, code: str = ..., path: str = ..., options: tuple[str, ...] = ..., backend: str = ...
    ) -> None: ...
    def get_function(self, name: str) -> RawKernel: ...
