"""The last good configs, newest last, for ``POST /admin/rollback``.

Every config the proxy ran (the one it started with, then each valid reload)
is kept here with the SHA-256 of the file it came from and the wall-clock
time it was applied, up to ``config_history`` entries, the running one
included. ``rollback`` drops the running entry and hands back the one
before it, which the reloader applies; so each rollback steps back one
config, and a reload after it starts a new branch. An invalid file never
enters: only configs that ran are "good". Pure data: no I/O, no clock but
the one passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from proxy.settings import Config


@dataclass(frozen=True, slots=True)
class ConfigEntry:
    """One config that ran."""

    config: Config
    #: SHA-256 hex of the file's bytes (``sha256sum config.yaml``); environment
    #: overrides are not in it.
    sha256: str
    #: When it was applied, ISO 8601 UTC.
    applied_at: str

    def describe(self) -> dict[str, str]:
        """What the admin API says of it (the config itself never: it holds keys)."""
        return {"sha256": self.sha256, "applied_at": self.applied_at}


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class ConfigHistory:
    """Up to ``limit`` good configs, oldest first; the last one is running."""

    __slots__ = ("_entries", "_now", "limit")

    def __init__(self, limit: int, now: Callable[[], str] = utc_now) -> None:
        self.limit = limit
        self._now = now
        self._entries: list[ConfigEntry] = []

    def applied(self, config: Config, sha256: str) -> ConfigEntry:
        """``config`` runs now; the oldest entries beyond the limit are forgotten.

        The running file applied again (a SIGHUP or ``POST /admin/reload`` of an
        unchanged file) replaces its own entry: as new entries, a few such reloads
        pushed every earlier config out, and a rollback then changed nothing.
        """
        entry = ConfigEntry(config, sha256, self._now())
        running = self.running
        if sha256 and running is not None and running.sha256 == sha256:
            self._entries[-1] = entry
        else:
            self._entries.append(entry)
        self.limit = config.config_history
        del self._entries[: max(0, len(self._entries) - self.limit)]
        return entry

    @property
    def running(self) -> ConfigEntry | None:
        return self._entries[-1] if self._entries else None

    @property
    def previous(self) -> ConfigEntry | None:
        """What a rollback would apply; None when there is nothing to go back to."""
        return self._entries[-2] if len(self._entries) > 1 else None

    def rolled_back(self) -> tuple[ConfigEntry, ConfigEntry]:
        """Drop the running entry: (the one now running again, the one dropped).

        Call only once the previous config has been applied; ``IndexError``
        when there is none (check ``previous`` first).
        """
        if len(self._entries) < 2:
            raise IndexError("no previous config")
        dropped = self._entries.pop()
        return self._entries[-1], dropped

    def describe(self) -> list[dict[str, str]]:
        """Newest first, as ``/admin/config`` and the rollback answer list them."""
        return [entry.describe() for entry in reversed(self._entries)]

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        running = self.running
        head = running.sha256[:12] if running is not None else "none"
        return f"<ConfigHistory {len(self._entries)}/{self.limit}, running {head}>"
