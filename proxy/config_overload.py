"""Rolling the proxy out and living with overload: ``mode``, ``overload``, ``config_history``.

``mode: observe`` forwards every request at once and only counts what the
enforcing proxy would have refused (``observe.py``); ``overload`` lowers the
output limit of listed classes once their budget pressure passes ``at``
(``pressure.py``, ``degrade.py``); ``config_history`` is how many good
configs ``POST /admin/rollback`` can step back through (``config_history.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from proxy.config_sections import Name, Section

__all__ = [
    "DEFAULT_CONFIG_HISTORY",
    "DEFAULT_MODE",
    "DEFAULT_OVERLOAD_AT",
    "DEFAULT_OVERLOAD_CLASSES",
    "Mode",
    "OverloadConfig",
    "overload_problems",
]

Mode = Literal["enforce", "observe"]
DEFAULT_MODE: Mode = "enforce"
#: Pressure (p95 queue wait over the queue budget, last 30 s) above which a class degrades.
DEFAULT_OVERLOAD_AT = 0.8
DEFAULT_OVERLOAD_CLASSES: tuple[str, ...] = ("batch",)
#: Good configs kept for ``POST /admin/rollback`` (the running one included).
DEFAULT_CONFIG_HISTORY = 5


class OverloadConfig(Section):
    """Degrade instead of refusing: cap the output of listed classes under pressure."""

    #: ``max_tokens`` of a degraded request (inserted when absent); null: never degrade.
    max_tokens_cap: int | None = Field(default=None, gt=0)
    #: The class's ``admission_budget_pressure`` must exceed this.
    at: float = Field(default=DEFAULT_OVERLOAD_AT, gt=0.0, le=1.0)
    #: Only these classes are ever degraded.
    classes: tuple[Name, ...] = DEFAULT_OVERLOAD_CLASSES


def overload_problems(
    overload: OverloadConfig, priorities: object
) -> list[tuple[tuple[str | int, ...], str]]:
    """With a cap set, every listed class must be configured (a typo would degrade nobody)."""
    if overload.max_tokens_cap is None or not isinstance(priorities, dict):
        return []
    known = ", ".join(priorities)
    return [
        (("classes", i), f"{cls!r}: unknown priority class (configured: {known})")
        for i, cls in enumerate(overload.classes)
        if cls not in priorities
    ]
