"""The auto-tuner's search: explain every point of a :class:`~megatron_slapo.tuning.space.Space`,
run only those that can win, keep every result, resume.

Slapo's tuner ran every point. Here each point is first planned (``tools/explain.py``'s estimates,
no training), then:

1. **refused** (the trainer's own checks reject it), **not explained** (explain itself failed on
   it) or **over the memory budget** (the estimated peak of its fullest rank): never run;
2. **dominated**: a point that differs from another only in how it saves memory (the symbols in
   ``savers``, e.g. recompute) and does at least its FLOPs and sends at least its traffic per step,
   while the other fits the budget, cannot be faster: it is skipped too, unless the other's trial
   fails, when it runs after all. Traffic is what each rank sends in ring collectives: an
   all-reduce twice its payload, other collectives once, a receive nothing;
3. the rest run, most promising (fewest FLOPs, then least traffic) first, as short real trials.
   Each result is appended to the results file at once, with the ``setting`` it was measured
   under, so a stopped search resumes where it was and re-runs nothing (a result of another
   setting is not used). Each plan is kept there too, so a resumed search explains nothing again
   (unless the planner's code changed: ``plan_version``).

The best point is the fastest trial; with ``confirm`` rounds, the trials within ``margin`` of it
run again in turn and the fastest median wins (two points whose costs tie differ only by noise).
``run`` takes a point's flags and returns a structured result (``step_seconds``, or ``error``);
:func:`search` neither launches nor parses anything itself.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from megatron_slapo.tuning.space import Point, Space


@dataclass
class Cost:
    """What explain says of a point: the fullest rank's peak bytes, FLOPs and ring traffic per step."""

    peak: int
    flops: float
    traffic: float


@dataclass
class Candidate:
    point: Point
    flags: list[str]
    cost: Cost | None = None
    reason: str | None = None  # why not run: "refused", "not explained", "over the memory budget", "dominated"
    why: str = ""  # the details, in words
    result: dict[str, Any] | None = None  # the trial's (or the results file's)
    resumed: bool = False
    times: list[float] = field(default_factory=list)  # step seconds: the trial's, then any confirmation's

    @property
    def seconds(self) -> float | None:
        """The median step time of its runs."""
        return statistics.median(self.times) if self.times else None

    @property
    def per_second(self) -> float:
        """Tokens (samples) per second at :attr:`seconds`."""
        return self.result["per_second"] * self.result["step_seconds"] / self.seconds


@dataclass
class Outcome:
    candidates: list[Candidate]
    best: Candidate | None
    ran: int  # trials run in this call (confirmation rounds aside)
    resumed: int  # trial results taken from the results file
    counts: dict[str, int] = field(default_factory=dict)  # why points were skipped -> how many
    ignored: int = 0  # results in the file measured under another setting
    plans_kept: int = 0  # points whose plan came from the results file (the rest were explained now)


def ring_traffic(comm: dict[str, int]) -> float:
    """Bytes a rank sends per step in ring collectives: an all-reduce is a reduce-scatter and an
    all-gather of its payload, so it counts twice; any other collective (an expert-parallel
    all-to-all of routed tokens included) once."""
    sent = {k: v for k, v in comm.items() if not k.startswith(("irecv", "recv"))}
    return sum(value * (2 if key.startswith("all_reduce") else 1) for key, value in sent.items())


def _describe(point: Point) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def _dominate(candidates: list[Candidate], savers: tuple[str, ...], failed: set[int]) -> None:
    """Mark the dominated points, afresh: a point that failed its trial (ids in ``failed``)
    dominates nothing, so what it dominated is free again unless another point dominates it."""
    for c in candidates:
        if c.reason == "dominated":
            c.reason, c.why = None, ""
    fits = [c for c in candidates if c.reason is None and id(c) not in failed]
    for worse in fits:
        layout = {k: v for k, v in worse.point.items() if k not in savers}
        for better in fits:
            if better is worse or {k: v for k, v in better.point.items() if k not in savers} != layout:
                continue
            a, b = better.cost, worse.cost
            no_worse = a.flops <= b.flops and a.traffic <= b.traffic
            if no_worse and (a.flops < b.flops or a.traffic < b.traffic):  # a tie runs both: noise decides
                # (transitive: a dominated ``better`` has a better of its own, which dominates ``worse`` too)
                worse.reason, worse.why = "dominated", f"by {_describe(better.point)}"
                break


class _Progress:
    """One line per trial: a bar of trials done and left, the best so far."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.done, self.stream = total, 0, stream

    def show(self, best: Candidate | None, last: Candidate) -> None:
        self.done += 1
        width = 20
        filled = width * self.done // max(self.total, 1)
        best_text = f"best {best.seconds * 1e3:.1f} ms/step ({_describe(best.point)})" if best else "no result yet"
        last_text = f"{last.seconds * 1e3:.1f} ms" if last.seconds is not None else last.result.get("error", "failed")
        source = " (from the results file)" if last.resumed else ""
        self.stream.write(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} trials, "
                          f"{self.total - self.done} left | {_describe(last.point)}: {last_text}{source} | "
                          f"{best_text}\n")  # fmt: skip
        self.stream.flush()


class _Results:
    """The results file: one JSON line per run (a trial is round 0, a confirmation round 1, 2, ...),
    written as each run ends, read back on resume: only the lines of the same ``setting``.

    It keeps each point's plan too (a line with ``plan``), as it is made: explaining every point
    takes minutes, so a resumed search reads them back, but only those of the same ``setting`` and
    ``plan_version`` (the planner's code: its figures change with it)."""

    def __init__(self, path: str | None, setting: dict[str, Any], plan_version: str) -> None:
        self.path, self.setting, self.plan_version = path, setting, plan_version
        self.known: dict[tuple[str, int], dict] = {}
        self.plans: dict[str, dict] = {}
        self.ignored = 0
        if path and os.path.exists(path):
            with open(path) as f:
                for line in filter(str.strip, f):
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short when the tuner was stopped
                        continue
                    same = row.get("setting") == setting
                    if "plan" in row:
                        if same and row["plan"].get("version") == plan_version:
                            self.plans[json.dumps(row["flags"])] = row["plan"]
                    elif same:
                        self.known[(json.dumps(row["flags"]), row.get("round", 0))] = row["result"]
                    else:
                        self.ignored += 1

    def _append(self, row: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def plan(self, c: Candidate, plan: Callable[[list[str]], Cost]) -> bool:
        """Set ``c``'s cost, or why it is out, from its kept plan or from ``plan``; whether it was kept."""
        kept = self.plans.get(json.dumps(c.flags))
        made = kept is None
        if made:
            kept = {"version": self.plan_version, **_planned(c.flags, plan)}
            self._append({"point": c.point, "flags": c.flags, "setting": self.setting, "plan": kept})
        if "cost" in kept:
            c.cost = Cost(*kept["cost"])
        else:
            c.reason, c.why = kept["reason"], kept["why"]
        return not made

    def get(self, c: Candidate, round_: int, run: Callable[[list[str]], dict[str, Any]]) -> tuple[dict, bool]:
        """The result of ``c`` in ``round_``, and whether it came from the file."""
        key = (json.dumps(c.flags), round_)
        if key in self.known:
            return self.known[key], True
        result = run(c.flags)
        self._append({"point": c.point, "flags": c.flags, "round": round_, "setting": self.setting, "result": result})
        return result, False


def _planned(flags: list[str], plan: Callable[[list[str]], Cost]) -> dict[str, Any]:
    """``plan(flags)`` as the results file keeps it: the cost, or why the point is out."""
    try:
        cost = plan(flags)
    except ValueError as e:  # the trainer's checks (ConfigError, SchedulingError)
        return {"reason": "refused", "why": str(e).splitlines()[0]}
    except Exception as e:  # explain itself tripped: the point is out, with why
        return {"reason": "not explained", "why": f"{type(e).__name__}: {e}".splitlines()[0]}
    return {"cost": [cost.peak, cost.flops, cost.traffic]}


def _confirm(contenders: list[Candidate], rounds: int, record: _Results, run: Callable, stream: TextIO) -> None:
    """Run each contender again, in turn, ``rounds`` times: machine noise then reaches them alike,
    and each is judged by the median of its runs."""
    for r in range(1, rounds + 1):
        for c in contenders:
            result, _ = record.get(c, r, run)
            if result.get("step_seconds") is not None:
                c.times.append(result["step_seconds"])
            stream.write(f"  confirming, round {r}/{rounds}: {_describe(c.point)}: median {c.seconds * 1e3:.1f} ms "
                         f"over {len(c.times)} runs\n")  # fmt: skip
            stream.flush()


def search(
    space: Space,
    flags_of: Callable[[Point], list[str]],
    plan: Callable[[list[str]], Cost],
    run: Callable[[list[str]], dict[str, Any]],
    budget: int,
    *,
    savers: tuple[str, ...] = ("recompute",),
    results: str | None = None,
    setting: dict[str, Any] | None = None,
    plan_version: str = "",
    stream: TextIO = sys.stdout,
    exhaustive: bool = False,
    confirm: int = 0,
    margin: float = 0.1,
) -> Outcome:
    """Search ``space`` as the module docstring says. A point ``plan`` raises on is refused (the
    trainer's checks say why). ``setting``: what else the trials depend on (the fixed flags, the
    ranks, the steps), recorded with each result. ``exhaustive``: run every point, as Slapo's tuner
    did (to check the pruned search against). ``confirm``: rounds in which the trials within
    ``margin`` of the fastest run again."""
    candidates = [Candidate(point, flags_of(point)) for point in space]
    record = _Results(results, setting or {}, plan_version)
    plans_kept = 0
    for c in candidates if not exhaustive else []:
        plans_kept += record.plan(c, plan)
        if c.cost is not None and c.cost.peak > budget:
            c.reason, c.why = "over the memory budget", f"{c.cost.peak / 2**20:,.1f} MiB estimated"
    chosen = [c for c in candidates if c.reason is None]
    if not exhaustive:
        _dominate(candidates, savers, set())
        chosen = sorted((c for c in chosen if c.reason is None), key=lambda c: (c.cost.flops, c.cost.traffic))
    progress = _Progress(len(chosen), stream)
    best: Candidate | None = None
    done: list[Candidate] = []
    while chosen:
        for c in chosen:
            c.result, c.resumed = record.get(c, 0, run)
            if c.result.get("step_seconds") is not None:
                c.times.append(c.result["step_seconds"])
            if c.seconds is not None and (best is None or c.seconds < best.seconds):
                best = c
            progress.show(best, c)
        done += chosen
        if exhaustive:
            break
        # a point that failed (out of memory after all, say) beats nothing: what only it beat runs now
        failed, ran = {id(c) for c in done if c.seconds is None}, {id(c) for c in done}
        _dominate(candidates, savers, failed)
        chosen = sorted((c for c in candidates if c.reason is None and id(c) not in ran),
                        key=lambda c: (c.cost.flops, c.cost.traffic))  # fmt: skip
        progress.total += len(chosen)
    contenders = [c for c in done if best and c.seconds is not None and c.seconds <= best.seconds * (1 + margin)]
    if confirm and len(contenders) > 1:
        _confirm(contenders, confirm, record, run, stream)
        best = min(contenders, key=lambda c: c.seconds)
    counts: dict[str, int] = {}
    for c in candidates:
        if c.reason:
            counts[c.reason] = counts.get(c.reason, 0) + 1
    resumed = sum(c.resumed for c in done)
    return Outcome(candidates, best, len(done) - resumed, resumed, counts, record.ignored, plans_kept)
