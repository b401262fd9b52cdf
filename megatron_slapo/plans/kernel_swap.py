"""The kernel-swap pass: HF formula modules replaced by one-kernel equivalents.

Schedules list it beside their plan (``plan_schedule(PLAN, swap_in_kernels)``), so what a schedule
does is read in the schedule; the kernels are in :mod:`megatron_slapo.kernels.drop_in`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_slapo.kernels.drop_in import kernel_for

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule


def swap_in_kernels(sch: Schedule) -> list[str]:
    """Replace every module under ``sch`` that has a drop-in kernel; return their paths. A module
    the plan sharded computes its own way already (a split RMSNorm's sum crosses the ranks): kept."""
    swaps = [(path, kernel) for path, node in sch.named_schedules()
             if not node.metadata.shards and (kernel := kernel_for(node.mod)) is not None]  # fmt: skip
    for path, kernel in swaps:
        sch[path].replace(kernel)
    return [path for path, _ in swaps]
