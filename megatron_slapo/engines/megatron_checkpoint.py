"""The megatron engine's state, in both checkpoint formats (:mod:`megatron_slapo.engines.base`).

:class:`MegatronCheckpoint` is mixed into :class:`~megatron_slapo.engines.megatron_core.MegatronEngine`,
whose constructor sets the attributes it declares.

- ``--ckpt-format torch`` (legacy): :meth:`~MegatronCheckpoint.state_dict` is this rank's stages'
  weights plus megatron-core's optimizer state and the LR schedule's; with the distributed optimizer
  its parameter state is gathered into Megatron-LM's own file (:data:`PARAMETER_STATE`) beside the
  rank's checkpoint file.
- ``--ckpt-format torch_dist``: :meth:`~MegatronCheckpoint.sharded_state` describes, in place, the
  most precise copy of each weight and its Adam moments where megatron-core's optimizer keeps them
  (:mod:`~megatron_slapo.engines.megatron_state` finds them); loading writes into those tensors and
  then updates the model's weights from them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.compat import megatron_cpu as cpu_compat
from megatron_slapo.engines.loss_scaler import load_scaler_state
from megatron_slapo.engines.megatron_state import (
    adam_optimizers,
    adam_steps,
    copy_main_to_model,
    describe,
    main_tensors,
    optimizer_parts,
    set_adam_steps,
)
from megatron_slapo.engines.sharded_state import EngineState, Fill, init_adam_state
from megatron_slapo.engines.stage_chunk import StageChunk
from megatron_slapo.errors import CheckpointError
from megatron_slapo.parallel.collectives import Group, group_size

PARAMETER_STATE = "distrib_optim.pt"  # Megatron-LM's file for the distributed optimizer's shards


class MegatronCheckpoint:
    """``state_dict``/``load_state_dict`` (``torch``) and ``sharded_state``/``load_sharded_state``
    (``torch_dist``) of the megatron engine, over the state its constructor builds."""

    # set by MegatronEngine.__init__
    args: argparse.Namespace
    dp_group: Group
    chunks: list[StageChunk]
    ddp: list[nn.Module]  # megatron-core's DDP, one per chunk
    optimizer: Any  # megatron-core's optimizer
    scheduler: Any  # megatron-core's OptimizerParamScheduler
    tensor_names: dict[str, list[str]]  # every weight's names in the whole model (megatron_state.all_names)

    # -- --ckpt-format torch -----------------------------------------------------------------------
    def _model_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' weights, under the model's own parameter names."""
        state: dict[str, torch.Tensor] = {}
        for chunk in self.chunks:
            state.update(chunk.stage.state_dict())
        return state

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict[str, Any]:
        """This rank's stages' weights and, with ``include_optimizer``, megatron-core's optimizer state
        (with the distributed optimizer: its parameter state gathered into Megatron-LM's
        ``distrib_optim.pt`` under ``directory`` by DP rank 0, and Adam's step count) and the LR
        schedule's."""
        state: dict[str, Any] = {"model": self._model_state()}
        if include_optimizer:
            with cpu_compat.device_mode():
                state["optimizer"] = self.optimizer.state_dict()
                if self.args.use_distributed_optimizer:
                    state["optimizer"] = {"distributed": state["optimizer"], "files": PARAMETER_STATE,
                                          "steps": adam_steps(self.optimizer)}  # fmt: skip
                    path = self._parameter_state_file(directory)
                    if self._dp_rank() == 0:
                        os.makedirs(os.path.dirname(path), exist_ok=True)
                    self.optimizer.save_parameter_state(path)  # gathered onto data-parallel rank 0
            state["opt_param_scheduler"] = self.scheduler.state_dict()  # the loss scaler is in the optimizer's
        return state

    def _dp_rank(self) -> int:
        """This rank's place in the data-parallel group (0 with one rank)."""
        return dist.get_rank(self.dp_group) if group_size(self.dp_group) > 1 else 0

    def _parameter_state_file(self, directory: str) -> str:
        """Where the distributed optimizer's parameter state goes, beside this rank's checkpoint file."""
        from megatron_slapo.parallel.state import Layout

        return os.path.join(directory, Layout.current().rank_dir(), PARAMETER_STATE)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], directory: str, load_optimizer: bool = True) -> None:
        """Load this rank's stages' weights (refusing a checkpoint that lacks some: another pipeline
        layout); then, when asked, the optimizer, which must match ``--use-distributed-optimizer``
        (``CheckpointError`` otherwise), and the LR schedule. Without the optimizer, its fp32 main
        weights are reloaded from the new weights."""
        saved = state["model"]
        for chunk in self.chunks:
            own = chunk.stage.state_dict()
            missing = sorted(set(own) - set(saved))
            if missing:
                raise RuntimeError(f"the checkpoint lacks {missing[:5]} (saved with another pipeline layout?)")
            chunk.stage.load_state_dict({k: saved[k] for k in own})
        for model in self.ddp:  # the optimizer's fp32 copies and the DDP buffers follow the weights
            model.zero_grad_buffer()
        if not (load_optimizer and "optimizer" in state):
            with cpu_compat.device_mode():
                self.optimizer.reload_model_params()
            return
        if "grad_scaler" in state and self.args.fp16:  # its fp32 optimizer state still fits fp32 runs
            raise CheckpointError(f"{directory} was saved by an earlier --fp16 of this engine (autocast over fp32 "
                                  "weights); load its weights with --no-load-optim")  # fmt: skip
        optimizer = _without_constant_scaler(state["optimizer"])
        distributed = isinstance(optimizer, dict) and "distributed" in optimizer
        if distributed != bool(self.args.use_distributed_optimizer):
            raise CheckpointError(
                f"{directory} was saved {'with' if distributed else 'without'} --use-distributed-optimizer; "
                "pass the same flag, or --no-load-optim to load only the weights"
            )
        with cpu_compat.device_mode():
            if distributed:
                self.optimizer.load_state_dict(optimizer["distributed"])
                for torch_optimizer in adam_optimizers(self.optimizer):
                    for param_state in torch_optimizer.state.values():
                        param_state.pop("step", None)
                self.optimizer.load_parameter_state(self._parameter_state_file(directory))
                set_adam_steps(self.optimizer, optimizer["steps"])
            else:
                self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(state["opt_param_scheduler"])

    # -- --ckpt-format torch_dist ------------------------------------------------------------------
    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """This rank's stages' weights (the fp32 main copies under --bf16/--fp16) and, with
        ``include_optimizer``, Adam's moments, where megatron-core's optimizer keeps them
        (:mod:`~megatron_slapo.engines.megatron_state`); the step count, the LR schedule and the
        fp16 loss scaler's state. The tensors are the live ones."""
        stages = [chunk.stage for chunk in self.chunks]
        state = EngineState(describe(stages, self.tensor_names, main_tensors(self.optimizer), include_optimizer))
        if include_optimizer:
            state.scalars = {
                "optimizer_step": adam_steps(self.optimizer),
                "opt_param_scheduler": self.scheduler.state_dict(),
            }
            if self.args.fp16:  # every chained optimizer's scaler steps alike
                state.scalars["grad_scaler"] = optimizer_parts(self.optimizer)[0].grad_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        """Give Adam its state (zeros) if it has none yet, let ``fill`` write into the tensors
        :meth:`sharded_state` describes, then cast the fp32 main weights into the model's (with the
        distributed optimizer, each rank its run, then all-gathered as after a step), clear the
        gradient buffers and set the step count, LR schedule and loss scale."""
        mains = main_tensors(self.optimizer)
        if load_optimizer:
            for torch_optimizer in adam_optimizers(self.optimizer):
                init_adam_state(torch_optimizer)
        state = self.sharded_state(load_optimizer)
        fill(state)
        stages = [chunk.stage for chunk in self.chunks]
        with cpu_compat.device_mode():
            copy_main_to_model(stages, mains)
            for model in self.ddp:
                if self.args.use_distributed_optimizer:
                    model.start_param_sync(force_sync=True)
                model.zero_grad_buffer()
        if load_optimizer:
            set_adam_steps(self.optimizer, state.scalars["optimizer_step"])
            self.scheduler.load_state_dict(state.scalars["opt_param_scheduler"])
            if self.args.fp16 and "grad_scaler" in state.scalars:
                for part in optimizer_parts(self.optimizer):
                    load_scaler_state(part.grad_scaler, state.scalars["grad_scaler"])


def _without_constant_scaler(state: Any) -> Any:
    """An optimizer state saved with ``--loss-scale`` holds the constant scaler's empty state, which a
    dynamic scaler cannot load: leave it out, so that the dynamic scale starts from its flags. (The
    state of megatron-core's chained optimizer is a list of states; the distributed one's is nested.)"""
    if isinstance(state, list):
        return [_without_constant_scaler(s) for s in state]
    if not isinstance(state, dict):
        return state
    return {k: _without_constant_scaler(v) if k == "distributed" else v for k, v in state.items()
            if not (k == "grad_scaler" and v == {})}  # fmt: skip
