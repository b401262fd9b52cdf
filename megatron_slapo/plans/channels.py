"""Channel parallelism for convolutional networks: Megatron's tensor parallelism with channels as
the features.

A convolution's weight is ``(out, in, *kernel)``, so ``ColumnParallel`` (output channels) and
``RowParallel`` (input channels, output all-reduced) split it as they split a Linear's. What a CNN
adds is the per-channel layers between and around them:

- :class:`ChannelParallelNorm`: a BatchNorm after a column-parallel convolution keeps its own
  channels' affine parameters *and running statistics*. Its statistics need no communication:
  each rank sees every sample of its channels, so mean and variance are the single-device ones.
- :class:`ShortcutChannels`: a residual shortcut added to a channel-split branch contributes its
  own channels. An identity's output is narrowed to them; its backward is the zero-padded
  gradient, which the block's ``ParallelRegionInput`` all-reduce completes, so it costs no
  collective of its own. A projection shortcut is split by the placements of its layers.
- :class:`GatherChannels`: the end of a region, where the next consumer needs every channel;
  what follows is replicated, so its backward keeps this rank's part of the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_slapo.compat.torch_nn import BatchNormNd
from megatron_slapo.parallel.collectives import own_part

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

CHANNELS = 1  # the channel axis of NCHW activations


@dataclass(frozen=True)
class ChannelParallelNorm:
    """Keep this rank's channels of a BatchNorm: weight, bias, running mean and variance."""

    def apply(self, sch: Schedule) -> None:
        if not isinstance(sch.mod, BatchNormNd):
            raise sch._error(f"ChannelParallelNorm is for a BatchNorm, not {type(sch.mod).__name__}")
        for name in ("weight", "bias", "running_mean", "running_var"):
            if getattr(sch.mod, name, None) is not None:
                sch.shard(name, axis=0)
        sch.mod.num_features //= sch.world_size


class _OwnChannels:
    """This rank's block of channels (autograd: the gradient zero-padded to every channel)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return own_part(x, CHANNELS, self.group)


@dataclass(frozen=True)
class ShortcutChannels:
    """A residual shortcut that meets a channel-split branch: an identity keeps this rank's channels
    (the others' gradient is zero here: the enclosing ``ParallelRegionInput`` sums the ranks'); a
    projection, whose layers the plan splits, is checked to be split."""

    def apply(self, sch: Schedule) -> None:
        if isinstance(sch.mod, nn.Identity):
            sch.sync("fwd_post", _OwnChannels(sch.group))
            return
        if not any(node.metadata.shards for _, node in sch.named_schedules()):
            raise sch._error("a projection shortcut must be split like the branch it meets: place its layers first")


@dataclass(frozen=True)
class GatherChannels:
    """All-gather a region's channel-split output for replicated consumers."""

    def apply(self, sch: Schedule) -> None:
        sch.sync("fwd_post", "all_gather", axis=CHANNELS, backward="split")
