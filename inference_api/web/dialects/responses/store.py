"""The stored responses of the Responses API (``store: true``): each kept with its team and its conversation, for
``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}``. Private to the team that made it (another
team's id is not found, as an unknown one), at most ``--responses-store-max`` of them (the oldest go first), each
for ``--responses-store-seconds``. In the server's one worker process's memory: a restart forgets them."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    team: str | None
    response: dict  # the response object as it was answered
    conversation: tuple[dict, ...]  # the chat messages up to and with this response's output (no instructions)
    at: float


class ResponseStore:
    def __init__(self, max_items: int, max_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.max_items, self.max_seconds, self.clock = max_items, max_seconds, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, team: str | None, response: dict, conversation: tuple[dict, ...]) -> None:
        if self.max_items <= 0:
            return
        with self._lock:
            self._expire()
            self._items[response["id"]] = Stored(team, response, conversation, self.clock())
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, team: str | None, response_id: str) -> Stored | None:
        """The team's stored response, or None (unknown, expired, or another team's: alike)."""
        with self._lock:
            return self._find(team, response_id)

    def delete(self, team: str | None, response_id: str) -> bool:
        with self._lock:
            if self._find(team, response_id) is None:
                return False
            del self._items[response_id]
            return True

    def _find(self, team: str | None, response_id: str) -> Stored | None:
        self._expire()
        stored = self._items.get(response_id)
        return stored if stored is not None and stored.team == team else None

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        horizon = self.clock() - self.max_seconds
        while self._items and next(iter(self._items.values())).at < horizon:
            self._items.popitem(last=False)
