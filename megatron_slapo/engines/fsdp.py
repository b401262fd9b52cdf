"""Fully sharded data parallelism with torch FSDP2 (``fully_shard``), under the schedule's TP.

Each transformer layer is one FSDP unit (its weights are all-gathered just before its forward and
backward and freed after), the root holds the rest (embeddings, final norm, head). Sharding is
over the data-parallel group only, so a tensor-parallel schedule keeps its layout: every TP rank
shards its own slices among its data-parallel peers (a 2-D TP x FSDP layout). ``--bf16``/``--fp16``
compute in half precision with fp32 sharded master weights and fp32 gradient reduction
(``MixedPrecisionPolicy``); fp16 adds Megatron's dynamic loss scale.

Checkpoints: with ``--ckpt-format torch``, ``model_optim_rng.pt`` holds the full (TP-local) weights,
gathered, and each rank's optimizer shard goes into ``iter_XXXXXXX/fsdp/<tp/pp rank>/dp_rank_XXX.pt``;
with ``torch_dist``, each rank describes the rows of the weights and moments it holds
(:meth:`FSDPEngine.sharded_state`) and nothing is gathered.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from megatron_slapo.engines.base import (
    Batch,
    ModelShape,
    StepResult,
    Task,
    adamw_state,
    evaluate,
    tensor_bytes,
    to_device,
)
from megatron_slapo.engines.local_step import LocalStep
from megatron_slapo.engines.optimizer import global_norm, half_precision, local_part
from megatron_slapo.engines.sharded_state import EngineState, Fill, Run, whole
from megatron_slapo.errors import CheckpointError
from megatron_slapo.kernels.fp8 import gather_weights_in_fp8
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.parallel.collectives import Group, allreduce_sequence_parallel_grads, group_rank, group_size

FILES = "fsdp"


TAGS = ("tensor_model_parallel", "sequence_parallel")  # Megatron's boolean tags (False where absent)
PARTITION_TAGS = ("partition_dim", "partition_stride")  # a tensor-parallel shard's axis and stride


def _parallel_tags(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Parameter name -> Megatron's tensor-parallel attributes on it: the boolean tags always, the
    partition's axis and stride where set (a distributed checkpoint places the shard by them)."""
    return {
        name: {**{tag: bool(getattr(p, tag, False)) for tag in TAGS},
               **{tag: getattr(p, tag) for tag in PARTITION_TAGS if hasattr(p, tag)}}
        for name, p in model.named_parameters()
    }  # fmt: skip


class FSDPEngine:
    """FSDP2 over the data-parallel group; AdamW and the LR schedule as with ``--engine ddp``."""

    # What --bf16/--fp16 mean here (printed at start: the engines differ)
    MIXED_PRECISION = {d: f"fp32 sharded weights, gathered in {d} for compute; gradients reduced in fp32"
                       for d in ("bf16", "fp16")}  # fmt: skip

    def __init__(
        self, model: nn.Module, args: argparse.Namespace, dp_group: Group, tp_group: Group, shape: ModelShape
    ) -> None:
        """Shard ``model`` with FSDP2 over ``dp_group``: one ``fully_shard`` unit per transformer layer and
        one for the rest, with the precision policy of ``--bf16``/``--fp16``; Megatron's tensor-parallel
        tags are put back on the sharded parameters, and the optimizer is built over the shards."""
        self.model, self.args, self.dp_group, self.tp_group = model, args, dp_group, tp_group
        self.device = next(model.parameters()).device
        tags = _parallel_tags(model)  # fully_shard replaces the parameters: keep the tags
        dtype = half_precision(args)
        # torch compares meshes by ranks and names, not by process group, and DTensor caches specs by
        # that equality: a mesh over the same ranks from an earlier initialisation (whose groups are
        # destroyed since) would be reused. The group's own name in the dimension name keeps them apart.
        mesh = DeviceMesh.from_group(dp_group, self.device.type, mesh_dim_names=(f"dp-{dp_group.group_name}",))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        if args.fp8_param_gather:  # before fully_shard: it shards the float8-gathered weights
            gather_weights_in_fp8(model)
        for path in transformer_layers(model, model.config.num_hidden_layers):
            fully_shard(model.get_submodule(path), mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for name, p in model.named_parameters():
            for tag, value in tags[name].items():
                setattr(p, tag, value)
        self.step = LocalStep(model, args)  # after fully_shard: over the sharded parameters
        self.params, self.optimizer = self.step.params, self.step.optimizer

    def memory_report(self) -> dict[str, int]:
        """Weights, gradients (reduce-scattered) and AdamW's two moments: all this rank's shards."""
        return adamw_state(tensor_bytes([local_part(p) for p in self.params]))

    def _norm(self, of_grads: bool = True) -> float:
        """The global norm of the gradients (or weights) over the TP shards and the DP shards."""
        return global_norm(self.params, self.tp_group, of_grads=of_grads, partition_group=self.dp_group)

    def train_step(self, microbatches: list[Batch], task: Task) -> StepResult:
        """Accumulate the micro-batches' gradients, reduce-scattered over DP once after the last one;
        sum each rank's sequence-parallel gradient shards over TP, then step as ``--engine ddp`` does."""
        self.model.train()

        def sync(last: bool) -> contextlib.AbstractContextManager:
            self.model.set_requires_gradient_sync(last)  # reduce-scatter once, after the last micro-batch
            return contextlib.nullcontext()

        totals = self.step.backward(microbatches, lambda b: task.loss(self.model, to_device(b, self.device)), sync)
        allreduce_sequence_parallel_grads(self.model, self.tp_group)  # each rank's shard, once a step
        return self.step.finish(totals, len(microbatches), self.dp_group, lambda grads: self._norm(of_grads=grads))

    def eval_step(self, microbatches: list[Batch], task: Task) -> dict[str, float]:
        """Forward only (FSDP gathers each unit as it runs), metrics averaged over DP."""
        return evaluate(self.model, microbatches, task, self.device, self.dp_group)

    # ----------------------------------------------------------------------------------------------
    def _optimizer_file(self, directory: str) -> str:
        """This rank's file of optimizer shards in the iteration directory."""
        from megatron.core import parallel_state as ps

        pp = ps.get_pipeline_model_parallel_rank()
        return os.path.join(directory, FILES, f"tp_{group_rank(self.tp_group):02d}_pp_{pp:03d}",
                            f"dp_rank_{group_rank(self.dp_group):03d}.pt")  # fmt: skip

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The TP rank's whole model on the CPU (weights all-gathered over the data-parallel group)."""
        gathered: dict[int, torch.Tensor] = {}
        state = {}
        for name, t in self.model.state_dict().items():
            if isinstance(t, DTensor):
                if id(t) not in gathered:
                    gathered[id(t)] = t.full_tensor().cpu()
                state[name] = gathered[id(t)]
            else:
                state[name] = t.detach().cpu().clone()
        return state

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        """The TP rank's whole weights (gathered over DP, so the checkpoint file is the same as every
        engine's); with ``include_optimizer``, this rank's AdamW shard written to its own file in
        ``directory`` (a pointer and the DP size kept here) and the LR schedule and loss scale."""
        state: dict[str, Any] = {"model": self.full_state_dict()}
        if include_optimizer:
            shard = self.optimizer.state_dict()  # its per-parameter dicts are the live state: copy, not edit
            shard["state"] = {
                index: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in values.items()}
                for index, values in shard["state"].items()
            }
            path = self._optimizer_file(directory)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(shard, path)
            state["optimizer"] = {"files": FILES, "data_parallel_size": group_size(self.dp_group)}
            state.update(self.step.state_dict())
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        """Take this rank's part of the whole saved weights; then, when asked, its optimizer shard, which
        must come from the same data-parallel size (``CheckpointError`` otherwise)."""
        full = state["model"]
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(full)), sorted(set(full) - set(own))
        if missing or unexpected:
            raise RuntimeError(f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        for name, t in own.items():
            value = full[name]
            if tuple(value.shape) != tuple(t.shape):
                raise RuntimeError(f"{name}: the checkpoint has shape {tuple(value.shape)}, the model {tuple(t.shape)}")
            local_part(t).copy_(local_part(_like(value.to(t.device, t.dtype), t)))
        saved = state.get("optimizer")
        if not (load_optimizer and saved):
            return
        if saved["data_parallel_size"] != group_size(self.dp_group):
            raise CheckpointError(
                f"{directory} holds FSDP optimizer shards for {saved['data_parallel_size']} data-parallel ranks, "
                f"this run has {group_size(self.dp_group)}; pass --no-load-optim to load only the weights"
            )
        path = self._optimizer_file(directory)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} (this rank's optimizer shard) is missing")
        self.optimizer.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))
        for p in self.params:  # the moments were saved as local shards: give them their layout back
            for k, v in self.optimizer.state[p].items():
                if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0:
                    self.optimizer.state[p][k] = _like(v, p, local=True)
        self.step.load_state_dict(state)

    # ----------------------------------------------------------------------------------------------
    def _reshard(self) -> None:
        """Every FSDP unit back on its shards: the root keeps its weights gathered after a forward
        with no backward (an evaluation), and the model would then name the gathered copies."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @torch.no_grad()
    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """This rank's rows of each parameter (its fp32 shard, also under ``--bf16``/``--fp16``: the
        half-precision copies exist only gathered, for compute) and, with ``include_optimizer``, the
        same rows of AdamW's moments; persistent buffers, which FSDP2 does not shard, whole."""
        self._reshard()
        state = whole(self.model, (lambda p: self.optimizer.state[p]) if include_optimizer else None, local_run)
        if include_optimizer:
            state.scalars = self.step.sharded_scalars()
        return state

    @torch.no_grad()
    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        """Load into the shards in place (the weights are fp32 and FSDP2 gathers the compute copies from
        them at each forward, so there is no other copy to update) and, when asked, into AdamW's
        moments (created first if it has not stepped yet); then the step count, LR schedule and loss scale."""
        self.step.load_sharded(self.sharded_state, fill, load_optimizer)


def local_run(t: torch.Tensor) -> Run:
    """The elements of ``t`` this rank holds, as a run of ``t`` flattened: a plain tensor whole, an
    FSDP2 DTensor its shard, rows of dim 0 split over the data-parallel mesh as ``torch.chunk``
    splits them (``ceil(n / size)`` rows per rank, the last ones short or empty). ``data`` is the
    live local shard (a view of it), so writing into it loads the parameter."""
    if not isinstance(t, DTensor):
        return Run(t.detach())
    if tuple(t.placements) != (Shard(0),):
        raise RuntimeError(f"expected an FSDP2 shard of dim 0 over a 1-D mesh, got placements {t.placements}")
    mesh = t.device_mesh
    rows, first = Shard.local_shard_size_and_offset(t.shape[0], mesh.size(), mesh.get_local_rank())
    local = t.detach().to_local()
    if local.shape[0] != rows or not local.is_contiguous():
        raise RuntimeError(f"a shard of {tuple(local.shape)} where rows [{first}, {first + rows}) were expected")
    return Run(local, first * math.prod(t.shape[1:]))


def _like(value: torch.Tensor, template: torch.Tensor, local: bool = False) -> torch.Tensor:
    """``value`` laid out like ``template``: a DTensor from the full tensor (or from this rank's shard)."""
    if not isinstance(template, DTensor):
        return value
    if local:
        return DTensor.from_local(value, template.device_mesh, template.placements, shape=template.shape,
                                  stride=template.stride())  # fmt: skip
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, template.device_mesh, template.placements, src_data_rank=None)  # local slicing
