"""What a real training step holds and moves on this rank: the measurement ``tools/explain.py``
is tested against.

- memory: the engine's own report (weights, gradients and optimizer state as built);
- activations: the bytes autograd saves for backward during one step, each storage once,
  parameters excluded, per micro-batch (every tensor saved is kept alive until the step ends, so
  that no freed storage is reused and counted twice);
- collectives: ``--log-comm``'s counts (:class:`CommLog`) over the step (the second: the first
  has one-off work, such as ZeRO-3 recording the order it gathers in);
- FLOPs: ``FlopCounterMode`` over the step (forward, backward and any recomputation).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.training.arguments import parse_args
from megatron_slapo.training.loop import setup
from megatron_slapo.tuning.trial import step_batches


def _parameters(engine) -> list[torch.nn.Parameter]:
    modules = [m for m in vars(engine).values() if isinstance(m, torch.nn.Module)]
    modules += [c for chunks in vars(engine).values() if isinstance(chunks, list)
                for c in chunks if isinstance(c, torch.nn.Module)]  # fmt: skip
    return [p for m in modules for p in m.parameters()]


def _address(p: torch.Tensor) -> int | None:
    try:
        return p.untyped_storage().data_ptr()
    except RuntimeError:  # FSDP2: a sharded weight's storage freed between uses
        return None


def measure(task: str, argv: list[str]) -> dict:
    """One training step of ``pretrain_<task>.py <argv>`` on every rank; this rank's measurements."""
    run = setup(parse_args(task, argv))
    kept, saved = [], {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in {_address(p) for p in _parameters(run.engine)}:  # read at each save: ZeRO-3 and FSDP gather
            saved[ptr] = storage.nbytes()
            kept.append(t)
        return t

    with step_batches(run) as next_step:
        run.engine.train_step(next_step(), run.task)  # a first step: ZeRO-3 records its gathering order in it
        micro = next_step()
        log = CommLog().install()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as flops:
                run.engine.train_step(micro, run.task)
            comm = log.take()
        finally:
            log.uninstall()
    layout = run.layout
    return {"coordinates": (layout.tp_rank, layout.pp_rank, layout.dp_rank), "memory": run.engine.memory_report(),
            "activations": sum(saved.values()) / len(micro), "comm": comm, "flops": flops.get_total_flops()}  # fmt: skip
