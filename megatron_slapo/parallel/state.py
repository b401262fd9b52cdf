"""Process groups: torch.distributed plus megatron-core's ``parallel_state``.

:func:`initialize` is the one call a training script makes before scheduling: it starts the
process group (from torchrun's environment, or a single local process), lays the ranks out as
tensor x pipeline x data parallel with megatron-core, and seeds the RNG streams. Everything else
(schedules, engines) asks this module for groups instead of building its own.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_slapo.compat.distributed import fake_store, is_live_group
from megatron_slapo.compat.megatron_internals import parallel_state_groups
from megatron_slapo.parallel import random as rng


def _megatron_initialized() -> bool:
    # Avoid importing megatron-core (seconds) just to learn that nobody initialised it.
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps is not None and ps.model_parallel_is_initialized()


def _destroy_model_parallel() -> None:
    """megatron-core's ``destroy_model_parallel``, but also shutting its process groups down: it
    only forgets them, and each gloo group keeps threads alive, so a process that initialises
    again and again (a test suite, a notebook) would pile up thousands of them."""
    from megatron.core import parallel_state as ps

    simulated = dist.is_initialized() and dist.get_backend() == "fake"
    groups = parallel_state_groups()
    ps.destroy_model_parallel()
    for group in groups:
        if group is not dist.group.WORLD and is_live_group(group):
            dist.destroy_process_group(group)
    groups.clear()
    if not simulated:  # a fake group (simulate()) runs no threads, and explain plans rank after rank
        gc.collect()  # a group sits in reference cycles: its threads end when it is collected


_launcher_store: dist.Store | None = None


def launcher_store(timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> dist.Store | None:
    """torchrun's key-value store for this restart round (keys prefixed with the round), or ``None``
    outside torchelastic. Reachable before the process group exists; connected once per process.

    ``torchrun --max-restarts`` restarts the workers against the same agent store (one per job with
    the static and the c10d rendezvous alike), and ``init_process_group`` would read the failed
    round's keys there: gloo then connects to the dead ranks' addresses (connection refused) or
    waits on stale start-up counters (a hang). A per-round prefix gives each round its own keys.
    """
    global _launcher_store
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    if _launcher_store is None:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        _launcher_store = dist.PrefixStore(f"megatron_slapo/restart_{restart}/", store)
    _launcher_store.set_timeout(timeout)
    return _launcher_store


def _restart_safe_rendezvous(timeout: datetime.timedelta) -> dict:
    """Under torchelastic, :func:`launcher_store` for ``init_process_group``, every wait bounded by
    ``timeout``; empty outside torchelastic (torch's defaults apply)."""
    store = launcher_store(timeout)
    if store is None:
        return {}
    return dict(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def initialize(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    *,
    seed: int = 1234,
    backend: str | None = None,
    timeout_minutes: int = 30,
    gloo_side_groups: bool = True,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    context_parallel: int = 1,
) -> None:
    """Start distributed training with ``tensor_parallel`` x ``pipeline_parallel`` model parallelism.

    The remaining factor of the world size is data parallelism, of which ``context_parallel``
    (Megatron's ``--context-parallel-size``) ranks at a time split each sequence between them
    (megatron-core's order: tensor, context, data, pipeline; ``parallel/context.py``). ``expert_parallel`` (Megatron's
    ``--expert-model-parallel-size``) carves groups of that many ranks out of the data-parallel ones
    for an MoE model's routed experts, each expert split by its features over
    ``expert_tensor_parallel`` ranks (default: the TP size, as in Megatron); megatron-core lays them
    out (its ``expert_model_parallel`` and ``expert_data_parallel`` groups).

    Works under ``torchrun`` (reads
    RANK/WORLD_SIZE/MASTER_ADDR) and as a plain single process. Uses NCCL when CUDA is available and
    gloo otherwise, in which case megatron-core's CPU shims are applied first. A process group
    already started is kept (:func:`simulate` starts a fake one). ``gloo_side_groups``:
    megatron-core's gloo copies of its data-parallel groups.
    """
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tensor={tensor_parallel} pipeline={pipeline_parallel}")
    cuda = torch.cuda.is_available()
    if not cuda:
        from megatron_slapo.compat import megatron_cpu as cpu_compat

        cpu_compat.apply()
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        backend = backend or ("nccl" if cuda else "gloo")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "WORLD_SIZE" in os.environ:
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timeout, **_restart_safe_rendezvous(timeout))
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel ({tensor_parallel}) x "
            f"pipeline_parallel ({pipeline_parallel}) x context_parallel ({context_parallel})"
        )
    if ps.model_parallel_is_initialized():
        _destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=gloo_side_groups,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel or tensor_parallel,
    )
    rng.seed(seed, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())


def simulate(world_size: int, rank: int, tensor_parallel: int = 1, pipeline_parallel: int = 1, *,
             seed: int = 1234, expert_parallel: int = 1, expert_tensor_parallel: int | None = None,
             context_parallel: int = 1) -> None:  # fmt: skip
    """Lay out rank ``rank`` of ``world_size`` in this one process, as :func:`initialize` would, over
    torch's fake process group: every group exists with its true size and this rank's place in it,
    and every collective returns at once, moving nothing. For planning a run (``tools/explain.py``)
    on meta tensors, whatever the cluster. megatron-core's gloo side groups are not created (the
    fake backend cannot host them); nothing that plans uses them.
    """
    if dist.is_initialized() and dist.get_backend() != "fake":
        raise RuntimeError("parallel.simulate() plans in a process of its own: this one runs a process group")
    destroy()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    initialize(tensor_parallel, pipeline_parallel, seed=seed, gloo_side_groups=False,
               expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
               context_parallel=context_parallel)  # fmt: skip


def destroy() -> None:
    """Tear down megatron-core's groups and the process group (for tests and clean exits)."""
    if _megatron_initialized():
        _destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tensor_parallel_group() -> dist.ProcessGroup | None:
    """The tensor-parallel group, or ``None`` before :func:`initialize`."""
    if not _megatron_initialized():
        return None
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


@dataclass(frozen=True)
class ExpertGroups:
    """An MoE layer's groups: ``model`` holds the routed experts between them (tokens move over it),
    ``tensor`` splits each expert by its features, ``data`` holds copies of the same experts (their
    gradients are reduced over it, not over the whole data-parallel group)."""

    model: dist.ProcessGroup | None
    tensor: dist.ProcessGroup | None
    data: dist.ProcessGroup | None
    tensor_and_model: dist.ProcessGroup | None  # the ranks that hold one copy of all the experts between them


def expert_groups() -> ExpertGroups | None:
    """The expert-parallel groups megatron-core laid out, or ``None`` before :func:`initialize`."""
    if not _megatron_initialized():
        return None
    from megatron.core import parallel_state as ps

    return ExpertGroups(ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                        ps.get_expert_data_parallel_group(), ps.get_expert_tensor_and_model_parallel_group())  # fmt: skip


def default_group() -> dist.ProcessGroup | None:
    """The group a schedule shards over when none is given.

    The tensor-parallel group if model parallelism is initialised, else the whole world if
    torch.distributed is, else ``None`` (single process: every collective is the identity).
    """
    group = tensor_parallel_group()
    if group is not None:
        return group
    if dist.is_initialized():
        return dist.group.WORLD
    return None


@dataclass
class Layout:
    """Where this rank sits: its TP/PP/DP coordinates decide its file and whether it writes.

    ``dp_rank``/``dp_group``: among the ranks holding copies of the same weights, whose gradients
    are averaged: the data-parallel ranks, times the context-parallel ones when the sequence is
    split (``cp_size`` > 1; megatron-core's ``with_context_parallel``). ``data_rank``: which
    micro-batches this rank reads (context-parallel ranks read the same, each its part of them).
    """

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None
    cp_rank: int = 0
    cp_size: int = 1
    data_rank: int = 0

    @classmethod
    def current(cls) -> Layout:
        """This process's coordinates, from megatron-core's parallel_state."""
        from megatron.core import parallel_state as ps

        split = ps.get_context_parallel_world_size() > 1
        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=split),
            dp_group=ps.get_data_parallel_group(with_context_parallel=split),
            cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
            data_rank=ps.get_data_parallel_rank(),
        )  # fmt: skip

    def coordinates(self) -> tuple[str, tuple[int, ...]]:
        """How the start-up and memory lines name this rank's place: ``(tensor, pipeline, data)``,
        and the context-parallel rank beside the data-parallel one when the sequence is split
        (``dp_rank`` counts both there, so it would label a context-parallel rank as data-parallel)."""
        if self.cp_size > 1:
            return "(tensor, pipeline, data, context)", (self.tp_rank, self.pp_rank, self.data_rank, self.cp_rank)
        return "(tensor, pipeline, data)", (self.tp_rank, self.pp_rank, self.dp_rank)

    def rank_dir(self) -> str:
        return f"mp_rank_{self.tp_rank:02d}" + (f"_{self.pp_rank:03d}" if self.pp_size > 1 else "")
