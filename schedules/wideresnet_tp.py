"""Megatron-style tensor parallelism for WideResNet: bottleneck channels split across ranks.

In each block the 1x1 reduce (and the projection shortcut) split their output channels, the 3x3
convolution its input channels (its output all-reduced), and the 1x1 expand its output channels
again; the BatchNorms after split convolutions keep their own channels and statistics, the one
after the all-reduce is replicated. The block's input gradient is all-reduced once, and its output
is all-gathered for the next block. Stem and classifier replicate. Under ``--sequence-parallel``
the replicated region in the middle of each block is split along the batch instead, its BatchNorm
normalising with the statistics of the whole batch, synchronised across the tensor-parallel group.
"""

from megatron_slapo.plans.channels import ChannelParallelNorm, GatherChannels, ShortcutChannels
from megatron_slapo.plans.sequence import plan_schedule
from megatron_slapo.plans.styles import ColumnParallel, ParallelRegionInput, RowParallel
from megatron_slapo.plans.sync_batchnorm import BatchStatistics

MODEL_TYPES = ("wideresnet",)  # HF config.model_type values this schedule is written for

BLOCK = "{layer1,layer2,layer3,layer4}.*"  # every block of the (up to) four stages
PLAN = {
    BLOCK: (ParallelRegionInput(sequence_dim=None), GatherChannels()),  # the block's input stays whole
    f"{BLOCK}.conv1": ColumnParallel(reduce_input_grad=False),
    f"{BLOCK}.conv2": RowParallel(sequence_dim=0),  # --sequence-parallel: reduce-scatter along the batch
    f"{BLOCK}.bn2": BatchStatistics(),  # --sequence-parallel: the whole batch's statistics
    f"{BLOCK}.conv3": ColumnParallel(sequence_dim=0),  # --sequence-parallel: all-gather the batch
    f"{BLOCK}.{{bn1,bn3}}": ChannelParallelNorm(),
    f"{BLOCK}.downsample.0": ColumnParallel(reduce_input_grad=False),
    f"{BLOCK}.downsample.1": ChannelParallelNorm(),
    f"{BLOCK}.downsample": ShortcutChannels(),  # an identity shortcut keeps this rank's channels
}
apply = plan_schedule(PLAN)
