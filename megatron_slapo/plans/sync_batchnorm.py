"""BatchNorm over a batch split across ranks: the statistics of the whole batch.

Under ``--sequence-parallel`` an image model's replicated regions hold this rank's part of the
batch, as a transformer's hold its part of the sequence. A BatchNorm there must still normalise
with the whole batch's mean and variance, or the model would differ from the single-device one:
each rank sums its part (values and squares, in one all-reduce over the tensor-parallel group),
and the backward all-reduces their gradients (every rank's loss depends on every part through them).

torch's ``nn.SyncBatchNorm`` does this on GPUs only (its statistics kernels are CUDA's, and it
refuses CPU tensors), so the statistics are computed here with plain ops, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_slapo.parallel.collectives import Group, group_size, reduce_backward, reduce_forward

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule


class _Shared:
    """A process group that copies of the module share (a group cannot be deep-copied)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


class GroupBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose batch statistics are those of the batch split over ``group`` (equal
    parts); in evaluation it uses its running statistics, the same on every rank (batch
    statistics again without ``track_running_stats``, as ``nn.BatchNorm2d``)."""

    def __init__(self, num_features: int, group: Group, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.shared = _Shared(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.shared.group
        if not (self.training or self.running_mean is None) or group_size(group) == 1:
            return super().forward(x)
        dims, shape = (0, 2, 3), (1, -1, 1, 1)
        local = x.numel() // x.size(1)
        count = local * group_size(group)
        # one all-reduce of every part's sum and sum of squares (the latter as its centred sum plus
        # local * mean^2, so the variance is E[x^2] - mean^2, clamped at 0 against rounding); every
        # rank's loss depends on every part through them, so the backward all-reduces too
        local_mean = x.mean(dims)
        moments = torch.cat([local * local_mean, (x - local_mean.view(shape)).square().sum(dims)
                             + local * local_mean.square()])  # fmt: skip
        sums, squares = (reduce_forward(reduce_backward(moments, group), group) / count).chunk(2)
        mean, var = sums, (squares - sums.square()).clamp_min(0)
        centred = x - mean.view(shape)
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach() * count / max(count - 1, 1))
        scale = torch.rsqrt(var + self.eps).view(shape)
        out = centred * scale
        return out * self.weight.view(shape) + self.bias.view(shape) if self.affine else out

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """As ``nn.BatchNorm2d``: an exponential average, or cumulative with ``momentum=None``."""
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.lerp_(mean, factor)
        self.running_var.lerp_(unbiased_var, factor)


@dataclass(frozen=True)
class BatchStatistics:
    """A BatchNorm in a region split along the batch under sequence parallelism: the statistics of
    the whole batch (:class:`GroupBatchNorm2d`), and its affine parameters' gradients, partial sums
    over the parts, summed as Megatron sums sequence-parallel parameters' gradients. Without
    sequence parallelism the placement does nothing."""

    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        if not self.sequence_parallel:
            return
        old = sch.mod
        if not isinstance(old, nn.BatchNorm2d):
            raise sch._error(f"BatchStatistics is for a BatchNorm2d, not {type(old).__name__}")
        with torch.device("meta"):
            new = GroupBatchNorm2d(old.num_features, sch.group, eps=old.eps, momentum=old.momentum,
                                   affine=old.affine, track_running_stats=old.track_running_stats)  # fmt: skip
        sch.replace(new)
        for name in ("weight", "bias"):
            if getattr(sch.mod, name, None) is not None:
                sch.annotate(name, "sequence_parallel", True)
