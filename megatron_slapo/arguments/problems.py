"""Input errors collected, so that one message names them all.

A user who leaves out three required flags should learn of all three from one run, not from
three. Validation adds each problem it finds to a :class:`Problems` and raises once: the missing
flags first, one clause per kind ("--micro-batch-size and --lr are required"), then every
contradiction, all joined with "; " into the one line the entry points print.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_slapo.errors import ConfigError


def joined(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


class Problems:
    """The problems found so far; :meth:`raise_if_any` reports them as one :class:`ConfigError`."""

    def __init__(self) -> None:
        self._missing: dict[str, list[str]] = {}  # a clause's ending -> its flags, in the order found
        self._found: list[str] = []

    def require(self, flag: str, unless: str = "") -> None:
        """``flag`` is needed and was not given; flags with the same ``unless`` (what the user may
        give instead of all of them) share one clause."""
        self._missing.setdefault(unless, []).append(flag)

    def add(self, message: str) -> None:
        """A contradiction or a value out of range, as the sentence that names its flags."""
        self._found.append(message)

    def __bool__(self) -> bool:
        return bool(self._missing or self._found)

    def message(self) -> str:
        clauses = []
        for unless, flags in self._missing.items():
            verb = "is" if len(flags) == 1 else "are"
            clauses.append(f"{joined(flags)} {verb} required" + (f" (or give {unless})" if unless else ""))
        return "; ".join(clauses + self._found)

    def raise_if_any(self) -> None:
        if self:
            raise ConfigError(self.message())
