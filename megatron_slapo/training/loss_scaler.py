"""fp16 loss scaling with Megatron's semantics, decided from the model-wide overflow check.

The scale multiplies the loss before backward so small fp16 activation gradients do not flush to
zero; gradients are unscaled before clipping. Whether a step overflowed is decided from the global
gradient norm (all-reduced over the tensor-parallel group), so every rank of a model skips the same
steps and keeps the same scale. Written here because megatron-core's scalers allocate on CUDA and
torch's ``GradScaler`` decides overflow per rank.
"""

from __future__ import annotations

import argparse


class LossScaler:
    """Dynamic (Megatron's DynamicGradScaler) or, with ``static=True``, constant loss scale."""

    def __init__(self, initial_scale: float, static: bool = False, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2) -> None:  # fmt: skip
        self.scale, self.static, self.min_scale = float(initial_scale), static, min_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (after ``hysteresis`` of them), grow after a clean run."""
        if self.static:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker, self._hysteresis_tracker = 0, self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._growth_tracker, self._hysteresis_tracker = state["growth_tracker"], state["hysteresis_tracker"]


def loss_scaler_for(args: argparse.Namespace) -> LossScaler | None:
    """The scaler Megatron's flags ask for: ``--loss-scale`` fixes it, else dynamic from
    ``--initial-loss-scale``, doubling after ``--loss-scale-window`` clean steps, halving after
    ``--hysteresis`` overflows, never below ``--min-loss-scale``; None without ``--fp16`` (bf16 and
    fp32 need none)."""
    if not args.fp16:
        return None
    if args.loss_scale is not None:
        return LossScaler(args.loss_scale, static=True)
    return LossScaler(args.initial_loss_scale, min_scale=args.min_loss_scale, growth_interval=args.loss_scale_window,
                      hysteresis=args.hysteresis)  # fmt: skip
