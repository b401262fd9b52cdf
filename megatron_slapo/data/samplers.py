"""Megatron's pretraining sampler: sequential global batches, resumable at any sample.

Global batch ``k`` is samples ``[k*G, (k+1)*G)`` of the (already shuffled) dataset; data-parallel
rank ``r`` takes micro-batches from its slice. Starting from ``consumed_samples`` instead of 0 is
what makes a resumed run see exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class PretrainingSampler:
    """Yields this data-parallel rank's micro-batches of indices, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the dataset's {total_samples} samples")
        self.total, self.consumed = total_samples, consumed_samples
        self.micro, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.micro * self.dp_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro * self.dp_size
        start = self.dp_rank * self.micro
        for first in range(self.consumed, self.total - step + 1, step):
            yield list(range(first + start, first + start + self.micro))


def data_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, workers: int):
    """A DataLoader over ``dataset`` for this rank, resuming at ``consumed_samples``."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    # A private generator: creating the iterator draws a worker seed, which must not advance the
    # global RNG that dropout uses (a resumed run would otherwise see different masks).
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, pin_memory=torch.cuda.is_available(),
        persistent_workers=workers > 0, generator=torch.Generator().manual_seed(consumed_samples),
    )  # fmt: skip
