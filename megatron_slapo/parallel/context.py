"""Where each context-parallel rank's tokens lie in the sequence (Megatron's load balancing).

Context parallelism (``--context-parallel-size C``) gives each of ``C`` ranks a part of every
sequence through the whole model. Under a causal mask the later tokens attend to more keys, so
contiguous parts would leave the first rank idle while the last works; Megatron cuts the sequence
into ``2C`` chunks and gives rank ``i`` chunks ``i`` and ``2C-1-i`` (``get_batch_on_this_cp_rank``
in megatron-core), one early and one late, so every rank does the same work. The data (tokens,
labels, positions) is cut here, and the ring attention reads the same layout to know which keys
each query may see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

CommType = Literal["p2p", "allgather"]  # the values of Megatron's --cp-comm-type implemented here


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place among the ``size`` context-parallel ranks of ``group``, and how the
    attention exchanges keys and values between them (``comm``)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    comm: CommType = "p2p"

    def __deepcopy__(self, memo: dict) -> ContextParallel:
        return self  # a copy of a module (a trace makes some) runs on the same ranks: process groups are not copied

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunks (of ``2 x size``) rank ``rank`` (default: this one) holds, in its order."""
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank

    def token_index(self, seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The positions in a ``seq_length`` sequence of this rank's tokens, in its order."""
        if seq_length % (2 * self.size):
            raise ValueError(f"a sequence of {seq_length} tokens does not cut into 2 x {self.size} equal chunks")
        chunk = seq_length // (2 * self.size)
        return torch.cat([torch.arange(k * chunk, (k + 1) * chunk, device=device) for k in self.chunks()])

    def local(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``tensor``, whose ``dim`` is the whole sequence (batch-first: dim 1)."""
        return tensor.index_select(dim, self.token_index(tensor.size(dim), tensor.device))

    def peer(self, offset: int) -> int:
        """The global rank ``offset`` places along the ring from this one."""
        local = (self.rank + offset) % self.size
        return dist.get_global_rank(self.group, local) if self.group is not None else local


def current(comm: CommType = "p2p") -> ContextParallel | None:
    """The context-parallel ranks megatron-core laid out, or ``None`` without context parallelism."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return ContextParallel(ps.get_context_parallel_group(), ps.get_context_parallel_rank(),
                           ps.get_context_parallel_world_size(), comm)  # fmt: skip
