"""torch.fx internals: ``MetaTracer``'s tensor metas and module patches, ``Tracer``'s flags, ``Node`` renaming.

``torch.fx.experimental.meta_tracer`` propagates meta tensors through a trace; it has no extension
points for what megatron_slapo/tracing/ changes, so those changes are made here, each undone after.

Written against torch 2.13.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental import meta_tracer

_MODULE_CALL = nn.Module.__call__  # torch's own, captured before any trace patches it


def has_tensor_meta(proxy: fx.Proxy) -> bool:
    """Whether MetaTracer computed the meta tensor of ``proxy``: its ``_tensor_meta`` attribute, set
    by ``install_tensor_meta``. Read from the instance dict: ``MetaAttribute.__getattr__`` would
    make a new proxy for a missing one. torch 2.13."""
    return "_tensor_meta" in proxy.__dict__


@contextlib.contextmanager
def module_getattr_disabled(tracer: fx.Tracer) -> Iterator[None]:
    """Inside, ``tracer`` does not turn module attribute reads into proxies: ``Tracer``'s private
    ``_disable_module_getattr`` flag, as MetaTracer sets it around running a module on meta
    tensors (a copy of a module, or a nested trace, must see the real attributes). torch 2.13."""
    tracer._disable_module_getattr = True
    try:
        yield
    finally:
        tracer._disable_module_getattr = False


@contextlib.contextmanager
def module_call_unpatched() -> Iterator[None]:
    """Inside, ``nn.Module.__call__`` is torch's own again, the patched one restored after. A trace
    patches it for its duration to record module calls; a module run eagerly inside the trace (a
    leaf on meta tensors) must call its children for real. torch 2.13."""
    patched = nn.Module.__call__
    nn.Module.__call__ = _MODULE_CALL
    try:
        yield
    finally:
        nn.Module.__call__ = patched


def rename_node(node: fx.Node, name: str) -> None:
    """``node._rename(name)``: rename a node within its graph's namespace (assigning ``node.name``
    would leave the old name reserved and the new one unchecked). torch 2.13."""
    node._rename(name)


@contextlib.contextmanager
def meta_tracer_patched(proxys_to_metas: Callable[[Any], Any], size: Callable[..., Any]) -> Iterator[None]:
    """Inside, MetaTracer runs with ``proxys_to_metas`` and ``MetaProxy.size`` replaced and without
    its ``torch.where`` override, all restored after (re-entrant: a nested trace saves what the outer
    one installed). MetaTracer reads ``meta_tracer.proxys_to_metas`` from its module at call time,
    ``size`` is a method of ``MetaProxy``, and ``manual_meta_overrides`` is a module dict: patching
    the module is the only way in. torch 2.13."""
    where = meta_tracer.manual_meta_overrides.pop(torch.where, None)
    previous, previous_size = meta_tracer.proxys_to_metas, meta_tracer.MetaProxy.size
    meta_tracer.proxys_to_metas = proxys_to_metas
    meta_tracer.MetaProxy.size = size
    try:
        yield
    finally:
        meta_tracer.proxys_to_metas = previous
        meta_tracer.MetaProxy.size = previous_size
        if where is not None:
            meta_tracer.manual_meta_overrides[torch.where] = where
