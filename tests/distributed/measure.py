"""What a real training step holds and moves on this rank: the measurement ``tools/explain.py``
is tested against.

- memory: the engine's own report (weights, gradients and optimizer state as built), and the
  most weight bytes held whole at once (``gathered``: read whenever autograd saves or uses a
  tensor; a ZeRO-3 weight is empty while released, an FSDP2 layer's weights are DTensor shards
  while resharded);
- activations: the bytes autograd saves for backward during one step, each storage once,
  parameters excluded, per micro-batch (every tensor saved is kept alive until the step ends, so
  that no freed storage is reused and counted twice);
- collectives: ``--log-comm``'s counts (:class:`CommLog`) over the step (the second: the first
  has one-off work, such as ZeRO-3 recording the order it gathers in);
- FLOPs: ``FlopCounterMode`` over the step (forward, backward and any recomputation).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.training.arguments import parse_args
from megatron_slapo.training.loop import setup
from megatron_slapo.tuning.trial import step_batches


def _parameters(engine) -> list[torch.nn.Parameter]:
    """The engine's weights, each once (DeepSpeed's engine and the module it wraps share them)."""
    modules = [m for m in vars(engine).values() if isinstance(m, torch.nn.Module)]
    modules += [c for chunks in vars(engine).values() if isinstance(chunks, list)
                for c in chunks if isinstance(c, torch.nn.Module)]  # fmt: skip
    return list({id(p): p for m in modules for p in m.parameters()}.values())


def _address(p: torch.Tensor) -> int | None:
    try:
        return p.untyped_storage().data_ptr()
    except RuntimeError:  # FSDP2: a sharded weight's storage freed between uses
        return None


def measure(task: str, argv: list[str]) -> dict:
    """One training step of ``pretrain_<task>.py <argv>`` on every rank; this rank's measurements."""
    run = setup(parse_args(task, argv))
    kept, saved, gathered = [], {}, [0]

    def held_whole() -> list[torch.nn.Parameter]:
        weights = _parameters(run.engine)  # read at each save and use: ZeRO-3 and FSDP gather
        whole = sum(p.numel() * p.element_size() for p in weights if not isinstance(p, DTensor))
        gathered[0] = max(gathered[0], whole)
        return weights

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in {_address(p) for p in held_whole()}:
            saved[ptr] = storage.nbytes()
            kept.append(t)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        held_whole()  # in the backward too: a weight gathered again for it counts
        return t

    with step_batches(run) as next_step:
        run.engine.train_step(next_step(), run.task)  # a first step: ZeRO-3 records its gathering order in it
        micro = next_step()
        log = CommLog().install()
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, unpack),
                FlopCounterMode(display=False) as flops,
            ):
                run.engine.train_step(micro, run.task)
            comm = log.take()
        finally:
            log.uninstall()
    layout = run.layout
    memory = {**run.engine.memory_report(), "gathered": gathered[0]}
    return {"coordinates": (layout.tp_rank, layout.pp_rank, layout.dp_rank), "memory": memory,
            "activations": sum(saved.values()) / len(micro), "comm": comm, "flops": flops.get_total_flops()}  # fmt: skip
