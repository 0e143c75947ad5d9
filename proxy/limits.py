"""Per-team concurrency limit. The proxy runs one worker process, so an in-process count is the global count."""
from __future__ import annotations

import threading


class Slot:
    """One admitted request; release() is idempotent, so every exit path may call it."""

    def __init__(self, limiter: "TeamLimiter | None", team: str | None):
        self._limiter = limiter
        self._team = team
        self._released = False

    def release(self) -> None:
        if self._limiter is not None and not self._released:
            self._released = True
            self._limiter._release(self._team)


class TeamLimiter:
    def __init__(self, max_per_team: int):
        self.max_per_team = max_per_team  # 0: no limit
        self._open: dict[str | None, int] = {}
        self._lock = threading.Lock()

    def acquire(self, team: str | None) -> Slot | None:
        """A slot for the team, or None when it already has max_per_team requests open."""
        if self.max_per_team <= 0:
            return Slot(None, team)
        with self._lock:
            count = self._open.get(team, 0)
            if count >= self.max_per_team:
                return None
            self._open[team] = count + 1
        return Slot(self, team)

    def open_requests(self, team: str | None) -> int:
        with self._lock:
            return self._open.get(team, 0)

    def _release(self, team: str | None) -> None:
        with self._lock:
            count = self._open.get(team, 0) - 1
            if count > 0:
                self._open[team] = count
            else:
                self._open.pop(team, None)
