"""The tuner on hardware not in hand: every layout ranked by its predicted step time.

``tools/autotune.py --hardware PROFILE --predict-only`` plans each point of the space as explain
does (:mod:`megatron_slapo.estimates.estimate`, with the attention kernel the profile's device runs)
and prices it with the time model (:mod:`megatron_slapo.estimates.time_model`): no trial, no
device. Points whose slowest rank needs more memory than the budget are dropped with their bytes.
Recomputation only adds time in the model, so of the points that differ only in it, the cheaper
one is planned first and the dearer ones only where it did not fit. ``--trials K`` then runs the
K best as real trials and reports predicted against measured for each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from megatron_slapo.errors import ConfigError
from megatron_slapo.estimates.time_model import Prediction
from megatron_slapo.tuning.space import Point, Space

RECOMPUTE_ORDER = ("none", "selective", "full")  # cheapest first: each only adds time


@dataclass
class Predicted:
    """One point: its flags and prediction, or why it was not predicted (refused, over memory)."""

    point: Point
    flags: list[str]
    prediction: Prediction | None = None
    why: str = ""

    @property
    def seconds(self) -> float:
        return self.prediction.step_time_s if self.prediction else float("inf")


def _by_recompute(space: Space) -> Iterator[list[Point]]:
    """The points in groups that differ only in their recompute value, cheapest first."""
    groups: dict[tuple, list[Point]] = {}
    for point in space:
        groups.setdefault(tuple((k, v) for k, v in point.items() if k != "recompute"), []).append(point)
    for points in groups.values():
        yield sorted(points, key=lambda p: RECOMPUTE_ORDER.index(p.get("recompute", "none")))


def rank_points(space: Space, flags_of: Callable[[Point], list[str]],
                plan: Callable[[list[str]], tuple[int, int, Prediction]], budget: int) -> list[Predicted]:  # fmt: skip
    """Every point predicted (or refused, or over the ``budget`` bytes), fastest first. ``plan``
    returns the largest peak of a point's ranks, that rank, and the prediction."""
    out: list[Predicted] = []
    for points in _by_recompute(space):
        for point in points:
            flags = flags_of(point)
            try:
                peak, rank, prediction = plan(flags)
            except ConfigError as e:
                out.append(Predicted(point, flags, why=f"refused: {e}"))
                break  # recomputing does not make a refused layout acceptable
            if peak > budget:
                out.append(Predicted(point, flags, why=f"over memory: rank {rank} needs {peak / 2**30:,.1f} GiB"))
                continue
            out.append(Predicted(point, flags, prediction))
            break
    return sorted(out, key=lambda p: p.seconds)


def describe(p: Predicted) -> str:
    """A point's one line: its values and predicted step, throughput, MFU and verdict."""
    values = " ".join(f"{k}={v}" for k, v in p.point.items())
    if p.prediction is None:
        return f"{values}: {p.why}"
    q = p.prediction
    return (f"{values}: {q.step_time_s:.4g} s per step, {q.tokens_per_s_per_device:,.0f} tokens/s per device, "
            f"MFU {q.mfu:.1%}; {q.verdict}")  # fmt: skip
