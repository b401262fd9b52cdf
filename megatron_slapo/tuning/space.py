"""A search space: named symbols, each with candidates that may depend on earlier choices, and
constraints over whole points.

    space = Space()
    space.symbol("tp", [1, 2, 4])
    space.symbol("pp", lambda point: [p for p in (1, 2) if world % (point["tp"] * p) == 0])
    space.symbol("sp", lambda point: [False, True] if point["tp"] > 1 else [False])
    space.constraint(lambda point: heads % point["tp"] == 0, "TP divides the heads")
    for point in space:  # {"tp": 1, "pp": 1, "sp": False}, ... in declaration order
        ...

Symbols are chosen in the order they were declared; a callable's candidates are asked for with
the choices made so far (the point up to that symbol), so a space only holds what can exist (no
sequence parallelism without tensor parallelism). Constraints see the complete point; a point
that breaks one is not in the space. This is Slapo's tuner's space (``create_symbol`` with
dependent candidates), with constraints that say why a point is out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

Point = dict[str, Any]
Candidates = Sequence[Any] | Callable[[Point], Sequence[Any]]


class Space:
    """Symbols (in order) and constraints; iterating yields every point that satisfies them."""

    def __init__(self) -> None:
        self._symbols: list[tuple[str, Candidates]] = []
        self._constraints: list[tuple[Callable[[Point], bool], str]] = []

    def symbol(self, name: str, candidates: Candidates) -> Space:
        """Declare ``name``: a list of candidates, or a function of the earlier choices giving one."""
        if any(name == known for known, _ in self._symbols):
            raise ValueError(f"symbol {name!r} is declared twice")
        self._symbols.append((name, candidates))
        return self

    def constraint(self, holds: Callable[[Point], bool], why: str) -> Space:
        """Keep only the points where ``holds(point)``; ``why`` names the rule (see :meth:`rejected`)."""
        self._constraints.append((holds, why))
        return self

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._symbols]

    def _points(self, index: int, point: Point) -> Iterator[Point]:
        if index == len(self._symbols):
            yield dict(point)
            return
        name, candidates = self._symbols[index]
        for value in candidates(point) if callable(candidates) else candidates:
            point[name] = value
            yield from self._points(index + 1, point)
        point.pop(name, None)

    def rejected(self, point: Point) -> str | None:
        """The first constraint ``point`` breaks, in words; None if it is in the space."""
        return next((why for holds, why in self._constraints if not holds(point)), None)

    def __iter__(self) -> Iterator[Point]:
        return (point for point in self._points(0, {}) if self.rejected(point) is None)

    def __len__(self) -> int:
        return sum(1 for _ in self)
