"""What a DeepSpeed engine holds, as runs of elements (``--ckpt-format torch_dist``), never gathered.

DeepSpeed keeps the numbers a checkpoint needs in one of three ways, by ZeRO stage:

- stage 0: every rank holds each parameter whole. AdamW steps the parameters themselves (fp32),
  or, under ``--bf16``/``--fp16``, DeepSpeed's unfused mixed-precision optimizer steps an fp32
  copy of each (its ``fp32_groups``, beside the ``fp16_groups`` they are copied into).
- stages 1 and 2: the parameters are whole on every rank, but each rank's AdamW steps one flat
  fp32 partition of all of them (the master weights, in fp32 runs too). A parameter's piece of it
  is one run, which DeepSpeed links to the parameter
  (:func:`~megatron_slapo.compat.deepspeed_internals.zero_fragment`); its moments are the same
  range of AdamW's flat state. DeepSpeed's ``update_lp_params`` copies the partitions into the
  parameters and all-gathers them, as after a step.
- stage 3: each parameter is partitioned: rank r holds elements ``[r * n, (r + 1) * n)`` of it
  flattened (``n = partition_numel()``; the last partition is padded past ``ds_numel``).
  DeepSpeed's public tensor-fragment API (``safe_get_local_fp32_param``,
  ``safe_get_local_optimizer_state`` and their setters) reads and writes this rank's fp32 master
  and moments of it; the forward gathers the weights from the partition ``ds_tensor``, which
  DeepSpeed copies from the master after a step.

Loading writes into the live tensors where DeepSpeed hands out views (ZeRO-3's getters may return
copies, which are set back), then updates the weights the forward reads from the fp32 masters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_slapo.compat.deepspeed_internals import zero_fragment
from megatron_slapo.engines.sharded_state import (
    MOMENTS,
    WEIGHT,
    EngineState,
    Fill,
    ParamShards,
    Run,
    adam_step,
    init_adam_state,
    named_once,
    set_adam_step,
    tensor_parallel_partition,
)


def _trained(t: torch.Tensor) -> bool:
    """A parameter the optimizer steps (buffers and frozen weights are the same on every rank)."""
    return isinstance(t, nn.Parameter) and t.requires_grad


class _WholeParams:
    """Stage 0: AdamW steps each parameter whole, or its fp32 copy under ``--bf16``/``--fp16``."""

    def __init__(self, optimizer: Any) -> None:
        """``optimizer``: torch's AdamW, or DeepSpeed's unfused mixed-precision optimizer around it."""
        self.adam = getattr(optimizer, "optimizer", optimizer)
        groups = zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", []), strict=True)
        self.copies = [(low, master) for lows, masters in groups for low, master in zip(lows, masters, strict=True)]
        self.masters = {id(low): master for low, master in self.copies}

    def params(self, model: nn.Module, include_optimizer: bool) -> list[ParamShards]:
        """Each parameter's fp32 weight and moments, whole."""
        out = []
        for names, t in named_once(model):
            master = self.masters.get(id(t), t)
            shards = ParamShards(names, t.shape, tensor_parallel_partition(t), {WEIGHT: Run(master.data)})
            state = self.adam.state.get(master, {}) if include_optimizer else {}
            shards.tensors.update({k: Run(state[k]) for k in MOMENTS if k in state})
            out.append(shards)
        return out

    def create_moments(self) -> None:
        """AdamW's state, zero, where it has none yet."""
        init_adam_state(self.adam)

    def commit(self) -> None:
        """The parameters from their fp32 copies."""
        for low, master in self.copies:
            low.data.copy_(master.data)


class _Fragments:
    """Stages 1 and 2 (and DeepSpeed's BF16_Optimizer): each rank steps a flat fp32 partition."""

    def __init__(self, optimizer: Any) -> None:
        """``optimizer``: DeepSpeed's ZeRO-1/2 optimizer, whose AdamW has one flat partition per group."""
        self.optimizer, self.adam = optimizer, optimizer.optimizer

    def params(self, model: nn.Module, include_optimizer: bool) -> list[ParamShards]:
        """Each parameter's piece of the fp32 partition and of AdamW's moments (nothing where this
        rank updates none of it); buffers and frozen weights whole."""
        flats = [group["params"][0] for group in self.adam.param_groups]
        out = []
        for names, t in named_once(model):
            shards = ParamShards(names, t.shape, tensor_parallel_partition(t))
            piece = zero_fragment(t) if _trained(t) else None
            if not _trained(t):
                shards.tensors[WEIGHT] = Run(t.data)
            elif piece is not None:
                master, start, offset, group = piece
                shards.tensors[WEIGHT] = Run(master, start)
                state = self.adam.state.get(flats[group], {}) if include_optimizer else {}
                moments = {k: Run(state[k].narrow(0, offset, master.numel()), start) for k in MOMENTS if k in state}
                shards.tensors.update(moments)
            out.append(shards)
        return out

    def create_moments(self) -> None:
        """AdamW's state over the flat partitions, zero, where it has none yet."""
        init_adam_state(self.adam)

    def commit(self) -> None:
        """The parameters from the fp32 partitions (copied, then all-gathered). Collective."""
        self.optimizer.update_lp_params()


class _Partitions:
    """Stage 3: each rank holds a partition of every parameter, and its fp32 master and moments."""

    def __init__(self, optimizer: Any, dp_rank: int) -> None:
        """``optimizer``: DeepSpeed's ZeRO-3 optimizer; ``dp_rank``: which partition this rank holds."""
        self.optimizer, self.adam, self.rank = optimizer, optimizer.optimizer, dp_rank
        self.held: list[tuple[nn.Parameter, dict[str, torch.Tensor]]] = []  # what params() handed out

    def _has_moments(self) -> bool:
        """Whether AdamW has its state yet (DeepSpeed creates it at the first step)."""
        return all("exp_avg" in self.adam.state.get(flat, {}) for flat in self.optimizer.fp32_partitioned_groups_flat)

    def params(self, model: nn.Module, include_optimizer: bool) -> list[ParamShards]:
        """Each parameter's partition of the fp32 master and moments, less the padding."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        moments = include_optimizer and self._has_moments()
        self.held, out = [], []
        for names, t in named_once(model):
            if not hasattr(t, "ds_id"):  # a buffer: ZeRO-3 partitions parameters only
                out.append(ParamShards(names, t.shape, tensor_parallel_partition(t), {WEIGHT: Run(t.data)}))
                continue
            size = t.partition_numel()
            start = self.rank * size
            valid = max(0, min(size, t.ds_numel - start))
            partition = {WEIGHT: safe_get_local_fp32_param(t) if t.requires_grad else t.ds_tensor.data}
            if moments and t.requires_grad:
                partition.update({k: safe_get_local_optimizer_state(t, k) for k in MOMENTS})
            self.held.append((t, partition))
            runs = {k: Run(v.view(-1)[:valid], start) for k, v in partition.items()} if valid else {}
            out.append(ParamShards(names, t.ds_shape, tensor_parallel_partition(t), runs))
        return out

    def create_moments(self) -> None:
        """AdamW's state over the flat fp32 partitions, zero, where it has none yet (DeepSpeed
        hands AdamW its partitions only for the step: they are not in its parameter groups now)."""
        init_adam_state(self.adam, list(self.optimizer.fp32_partitioned_groups_flat))

    def commit(self) -> None:
        """Set what :meth:`params` handed out (in place already, unless DeepSpeed gave copies), copy
        the fp32 masters into the partitions the forward gathers, and drop the gathered copies it
        keeps of small parameters, so that the next forward gathers the new values. Collective."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param, safe_set_local_optimizer_state

        for t, partition in self.held:
            if not t.requires_grad:
                continue
            safe_set_local_fp32_param(t, partition[WEIGHT])
            for k in MOMENTS:
                if k in partition:
                    safe_set_local_optimizer_state(t, partition[k], k)
            t.ds_tensor.data.copy_(safe_get_local_fp32_param(t).view_as(t.ds_tensor))
        self.optimizer.empty_partition_cache()


class DeepSpeedState:
    """A DeepSpeed engine's state on this rank: described as runs, and loaded in place."""

    def __init__(self, model: nn.Module, optimizer: Any, scheduler: Any, stage: int, dp_rank: int, fp16: bool) -> None:
        """``optimizer``: what ``deepspeed.initialize`` returned for ZeRO ``stage``; ``scheduler``:
        megatron-core's LR schedule; ``fp16``: whether a loss scaler's state belongs in the checkpoint."""
        self.model, self.optimizer, self.scheduler, self.fp16 = model, optimizer, scheduler, fp16
        self.layout = (
            _Partitions(optimizer, dp_rank) if stage == 3 else _WholeParams(optimizer) if stage == 0
            else _Fragments(optimizer)
        )  # fmt: skip

    def _scalars(self) -> dict[str, Any]:
        """Adam's step count, the LR schedule's state, and under ``--fp16`` the loss scaler's."""
        scalars = {"optimizer_step": adam_step(self.layout.adam), "opt_param_scheduler": self.scheduler.state_dict()}
        if self.fp16:
            scalars["grad_scaler"] = grad_scaler_state(self.optimizer)
        return scalars

    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        """Each parameter's fp32 weight and (``include_optimizer``) moments as this rank holds them,
        and the scalars; the tensors are the live ones where DeepSpeed allows."""
        state = EngineState(self.layout.params(self.model, include_optimizer))
        if include_optimizer:
            state.scalars = self._scalars()
        return state

    @torch.no_grad()
    def load(self, fill: Fill, load_optimizer: bool = True) -> None:
        """``fill`` the fp32 weights (and moments, step count, LR schedule, loss scale), then the
        weights the forward reads from them. Collective (stages 1-3)."""
        if load_optimizer:
            self.layout.create_moments()
        state = self.sharded_state(load_optimizer)
        fill(state)
        self.layout.commit()
        if load_optimizer:
            set_adam_step(self.layout.adam, state.scalars["optimizer_step"])
            self.scheduler.load_state_dict(state.scalars["opt_param_scheduler"])
            if self.fp16 and "grad_scaler" in state.scalars:
                load_grad_scaler_state(self.optimizer, state.scalars["grad_scaler"])


def _dynamic_scaler(optimizer: Any) -> Any | None:
    """DeepSpeed's dynamic fp16 loss scaler: ZeRO's ``loss_scaler`` (with hysteresis) or the stage-0
    optimizer's ``loss_scale_config`` (without); None for a fixed scale."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None:
        return scaler if getattr(scaler, "dynamic", False) else None
    config = getattr(optimizer, "loss_scale_config", None)
    return config if config is not None and config.dynamic_loss_scale else None


def grad_scaler_state(optimizer: Any) -> dict[str, Any]:
    """DeepSpeed's loss scale in megatron-core's ``DynamicGradScaler`` form (``{}`` for a fixed
    scale, as megatron-core's ``ConstantGradScaler``). DeepSpeed doubles the scale at the clean
    step that finds ``window`` clean steps *before* it since the last overflow; megatron-core at
    the clean step that makes ``growth_tracker`` reach ``window``. So ``k`` clean steps since the
    last overflow (``k > 0``) are a ``growth_tracker`` of ``(k - 1) % window``, and none is -1
    (megatron-core then grows one step later than from 0, as DeepSpeed does). Both halve when the
    overflow finds the hysteresis at 1."""
    scaler = _dynamic_scaler(optimizer)
    if scaler is None:
        return {}
    clean = scaler.cur_iter - scaler.last_overflow_iter - 1
    return {
        "scale": torch.tensor([float(scaler.cur_scale)]),
        "growth_tracker": (clean - 1) % scaler.scale_window if clean > 0 else -1,
        "hysteresis_tracker": getattr(scaler, "cur_hysteresis", 1),
    }


def load_grad_scaler_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Set DeepSpeed's loss scale from :func:`grad_scaler_state`'s form (a fixed scale, or a saved
    one without ``scale``, is left as the flags set it)."""
    scaler = _dynamic_scaler(optimizer)
    if scaler is None or "scale" not in state:
        return
    scaler.cur_scale = float(state["scale"])
    scaler.last_overflow_iter = scaler.cur_iter - int(state["growth_tracker"]) - 2  # growth_tracker + 1 clean steps
    if hasattr(scaler, "cur_hysteresis"):
        scaler.cur_hysteresis = max(int(state["hysteresis_tracker"]), 1)
