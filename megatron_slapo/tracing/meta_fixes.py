"""Fixes to torch's ``MetaTracer`` (meta-tensor shape propagation during fx tracing).

MetaTracer evaluates every traced op on meta tensors to know shapes while tracing; a few of its
behaviours break HF code. The fixes are in effect only inside :func:`meta_tracer_fixes` (module
attributes patched by :mod:`megatron_slapo.compat.fx`, restored after), plus helpers the tracer
uses to evaluate ops itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental import meta_tracer

from megatron_slapo.compat.fx import has_tensor_meta, meta_tracer_patched
from megatron_slapo.compat.transformers_internals import experts_implementation


def metas(value: Any) -> Any:
    """MetaTracer's proxys_to_metas, plus attribute proxies (``outputs.last_hidden_state``), whose
    meta MetaTracer never computes: it is the attribute of the owner's meta."""
    if isinstance(value, meta_tracer.MetaAttribute) and not isinstance(value, meta_tracer.MetaDeviceAttribute):
        if not has_tensor_meta(value):
            return getattr(metas(value.root), value.attr)
    return _original_proxys_to_metas(value)


_original_proxys_to_metas = meta_tracer.proxys_to_metas


def all_metas(value: Any) -> Any:
    """:func:`metas`, and real tensors moved to the meta device (for evaluating on meta)."""
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return value.to("meta")
    return metas(value)


def has_real_tensor(value: Any) -> bool:
    """Whether a (nested) argument structure holds a tensor that is not on the meta device."""
    found = False

    def visit(v: Any) -> Any:
        nonlocal found
        found = found or (isinstance(v, torch.Tensor) and not v.is_meta)
        return v

    fx.node.map_aggregate(value, visit)
    return found


def _size(self: meta_tracer.MetaProxy, dim: int | None = None) -> Any:
    """``MetaProxy.size`` that honours ``dim=0``: torch's tests ``if dim``, so ``x.size(0)`` returned
    the whole shape (and ``x.reshape(x.size(0), -1)`` lost its meta)."""
    try:
        meta = metas(self)
    except (AssertionError, AttributeError):  # no meta was computed for it
        meta = None
    if isinstance(meta, torch.Tensor):
        return meta.size() if dim is None else meta.size(dim)
    return self.tracer.create_proxy("call_method", "size", (self,) if dim is None else (self, dim), {})


@contextlib.contextmanager
def meta_tracer_fixes() -> Iterator[None]:
    """Three fixes to torch's MetaTracer, in effect only while we trace:

    - its ``torch.where`` override breaks on HF's ``torch.where(mask, 0.0, min)``; torch.where runs
      on meta tensors natively, so the override is dropped (real operands: see :func:`evaluate_on_meta`);
    - it never computes metas of attribute proxies (``outputs.last_hidden_state``): see :func:`metas`;
    - ``MetaProxy.size(0)`` returns the whole shape: see :func:`_size`.
    """
    with meta_tracer_patched(metas, _size):  # re-entrant: child levels are traced inside a parent's trace
        yield


@contextlib.contextmanager
def experts_on_meta(module: torch.nn.Module) -> Iterator[None]:
    """HF's MoE experts (mixtral, qwen3_moe, ...) run with the ``batched_mm`` implementation while
    ``module`` runs on meta tensors: the default ``grouped_mm``'s meta kernel takes only bf16 (and
    FlopCounterMode counts none of its FLOPs), and ``eager`` branches on which experts are used.
    ``batched_mm`` has the same shapes and does the same multiplies, each token times its experts."""
    configs = {id(m.config): m.config for m in module.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "config")}
    with experts_implementation(configs.values(), "batched_mm"):
        yield


def evaluate_on_meta(kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
    """Evaluate a ``call_function`` / ``call_method`` node on meta tensors, real ones moved there."""
    meta_args, meta_kwargs = fx.node.map_aggregate((args, kwargs), all_metas)
    if kind == "call_function":
        return meta_tracer.manual_meta_overrides.get(target, target)(*meta_args, **meta_kwargs)
    return getattr(meta_args[0], target)(*meta_args[1:], **meta_kwargs)
