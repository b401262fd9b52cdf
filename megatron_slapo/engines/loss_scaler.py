"""fp16 loss scaling: megatron-core's ``DynamicGradScaler`` / ``ConstantGradScaler`` from Megatron's flags.

The megatron engine hands the flags to megatron-core's optimizer, which builds the same scaler
itself. The engines that step their own optimizer (DDP, FSDP2) take it from here and decide
``found_inf`` from the model-wide gradient norm, so every rank of a model skips the same steps and
keeps the same scale. The scalers keep the scale as a one-element tensor on the device (they
allocate on "cuda"; :func:`megatron_slapo.compat.megatron_cpu.device_mode` maps that onto the CPU when there is no GPU).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from megatron_slapo.compat import megatron_cpu as cpu_compat


def loss_scaler_for(args: argparse.Namespace) -> Any | None:
    """The scaler Megatron's flags ask for: ``--loss-scale`` fixes it, else dynamic from
    ``--initial-loss-scale``, doubling after ``--loss-scale-window`` clean steps, halving after
    ``--hysteresis`` overflows, never below ``--min-loss-scale``; None without ``--fp16`` (bf16 and
    fp32 need none)."""
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if not args.fp16:
        return None
    with cpu_compat.device_mode():
        if args.loss_scale is not None:
            return ConstantGradScaler(args.loss_scale)
        return DynamicGradScaler(initial_scale=args.initial_loss_scale, min_scale=args.min_loss_scale,
                                 growth_factor=2.0, backoff_factor=0.5, growth_interval=args.loss_scale_window,
                                 hysteresis=args.hysteresis)  # fmt: skip


def load_scaler_state(scaler: Any, state: dict) -> None:
    """Restore a scaler. A constant scaler saved nothing (a dynamic one then starts from its flags);
    a checkpoint written before the scale was a tensor holds a float."""
    if "scale" not in state:
        return
    if not isinstance(state["scale"], torch.Tensor):
        state = {**state, "scale": torch.tensor([float(state["scale"])])}
    with cpu_compat.device_mode():
        scaler.load_state_dict(state)
