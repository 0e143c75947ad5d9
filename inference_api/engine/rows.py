"""Free list over the fixed user-row indices (each row owns one slice of the KV cache)."""

from __future__ import annotations

import heapq


class RowTable:
    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows))  # a heap: the lowest free row first keeps the active rows packed low

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_rows - len(self._free)

    def allocate(self, row: int | None = None) -> int | None:
        """The lowest free row, or ``row`` when it is free (the row whose cache holds a request's prefix)."""
        if row is not None and row in self._free:
            self._free.remove(row)
            heapq.heapify(self._free)
            return row
        return heapq.heappop(self._free) if self._free else None

    def free(self, row: int) -> None:
        if not 0 <= row < self.num_rows or row in self._free:
            raise ValueError(f"row {row} is not in use")
        heapq.heappush(self._free, row)
