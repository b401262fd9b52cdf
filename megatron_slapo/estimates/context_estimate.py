"""What context parallelism adds to ``tools/explain.py``'s estimate of a rank.

Under ``--context-parallel-size C`` each rank runs every layer on ``S/C`` tokens of each sequence
(:mod:`~megatron_slapo.parallel.context`). The meta pass gets them as the trainer does (the task
cuts this rank's two chunks out of the micro-batch), so its activations and FLOPs are already a
rank's. The attention core is the ring (``kernels/ring_attention.py``), which on the meta device
exchanges nothing but saves what the ring saves (q, k, v, the output, a log-sum-exp per row),
runs its block products and tells an observer of each call (``observing_meta``): the bytes the
real ring moves are counted from there (:func:`exchange_bytes`), as ``--log-comm`` counts them.
Per attention layer and micro-batch, with ``block`` the keys and values stacked
(``2 x batch x kv heads here x S/C x the wider head dim x bytes``) and ``grad`` the same shape
in the ring's summing dtype (fp32; fp64 for an fp64 model):

- ``p2p``: forward, ``C - 1`` hops of ``block`` (an ``isend`` and an ``irecv`` each); backward,
  ``C - 1`` hops of ``block`` again and ``C`` hops of ``grad``, which returns to its owner;
- ``allgather``: forward, one ``all_gather_single`` of ``C x block``; backward, the same gather
  again and one ``reduce_scatter_single`` of ``C x grad``.

A recomputed core (selective recompute, or a whole layer under full recompute) runs its forward,
and so its exchange, once more in the backward; the observer sees each run. The loss's sums
across the ranks (one fp32 pair per micro-batch) go through the fake process group and are
counted with the model's other collectives.

The weights are whole on every context-parallel rank: their copies are the data-parallel x
context-parallel ranks (megatron-core's ``with_context_parallel`` group), over which gradients
are reduced and the distributed optimizer and FSDP shard (:func:`weight_replicas`).
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from megatron_slapo.kernels.attention_blocks import summed
from megatron_slapo.kernels.ring_attention import observing_meta
from megatron_slapo.parallel.comm_log import group_names
from megatron_slapo.parallel.context import ContextParallel


def weight_replicas(args: argparse.Namespace) -> int:
    """The ranks holding copies of the same weights: data-parallel x context-parallel."""
    return args.data_parallel_size * args.context_parallel_size


def replicas_group(args: argparse.Namespace) -> str:
    """What ``--log-comm`` calls the trainer's group of those ranks (``Layout.dp_group``, which the
    engines reduce gradients and average metrics over): megatron-core's data-parallel group,
    ``dp``, or with context parallelism its data-parallel x context-parallel one, ``dp-cp``."""
    return "dp-cp" if args.context_parallel_size > 1 else "dp"


def exchange_bytes(phase: str, cp: ContextParallel, k: torch.Tensor, v: torch.Tensor, group: str) -> Counter[str]:
    """The bytes one call of the ring moves in ``phase`` (``"forward"`` or ``"backward"``) with this
    rank's keys ``k`` and values ``v`` (``[batch, kv heads, tokens, dim]``), keyed as ``--log-comm``
    keys them over the process group named ``group``."""
    if cp.size == 1:
        return Counter()
    elements = 2 * k.size(0) * k.size(1) * k.size(2) * max(k.size(-1), v.size(-1))  # k and v, the narrower padded
    block = elements * k.element_size()
    grad = elements * torch.finfo(summed(k.dtype)).bits // 8
    if cp.comm == "allgather":
        moved = Counter({f"all_gather_single[{group}]": cp.size * block})
        if phase == "backward":
            moved[f"reduce_scatter_single[{group}]"] += cp.size * grad
        return moved
    hops = (cp.size - 1) * block + (cp.size * grad if phase == "backward" else 0)
    return Counter({f"isend[{group}]": hops, f"irecv[{group}]": hops})


@contextlib.contextmanager
def counting_exchanges(add: Callable[[Counter[str]], None]) -> Iterator[None]:
    """While open, every run of the ring on the meta device calls ``add`` with the bytes the real
    ring would move (:func:`exchange_bytes`; a recomputed forward again)."""
    names = group_names()

    def observe(phase: str, cp: ContextParallel, k: torch.Tensor, v: torch.Tensor) -> None:
        group = names.get(cp.group, "other")  # "other": CommLog's name for a group it has none for
        add(exchange_bytes(phase, cp, k, v, group))

    with observing_meta(observe):
        yield
