"""A one-process stand-in for an mpi4py communicator, for code that takes ``comm``."""

from __future__ import annotations

from typing import Any


class OneRank:
    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def gather(self, value: Any, root: int = 0) -> list[Any]:
        return [value]

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value
