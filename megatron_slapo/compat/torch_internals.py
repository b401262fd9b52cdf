"""torch's private tensor, storage, operator, dispatch and profiler names.

Written against torch 2.13.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ATTENTION_OPS", "FREE_OPS", "GEMM_OPS", "SDPA_FUNCTIONS", "TorchDispatchMode", "allocation_events", "flash_attention", "flop_formulas", "foreach_mul_", "in_autograd_engine", "op_schema",
           "storage_key", "tensor_version", "view_base"]  # fmt: skip

# TorchDispatchMode (torch.utils._python_dispatch) is torch's documented way to see every operator
# below autograd, but it lives in a private module; re-exported here. torch 2.13.

# What fx records as the target of a traced ``F.scaled_dot_product_attention`` call: the function
# itself, or the C binding behind it (``torch._C._nn``) that HF's code may reach. torch 2.13.
SDPA_FUNCTIONS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)


# ATen operators by the work they do, for the time model's ledger (estimates/op_ledger.py); several
# are private ATen names (the fused attention kernels, FP8's scaled GEMM). torch 2.13.
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "convolution_backward"}
ATTENTION_OPS = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")  # prefixes
FREE_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh", "_unsafe_view",
            "_local_scalar_dense", "set_", "resize_"}  # allocations and bookkeeping: no kernel's work  # fmt: skip


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``: the counter of in-place writes to ``t`` (autograd's check that a saved
    tensor is unchanged); no public API exposes it. torch 2.13."""
    return t._version


def view_base(value: Any) -> torch.Tensor | None:
    """``value._base``: the tensor a view was taken of (``None`` for a tensor that is no view, or
    for anything that is no tensor); torch has no public accessor. torch 2.13."""
    return getattr(value, "_base", None)


def storage_key(storage: torch.UntypedStorage) -> int:
    """``storage._cdata``: the address of the storage's C++ ``StorageImpl``, which every view of it
    shares. ``data_ptr()`` would do on a real device, but every meta storage has address 0. torch 2.13."""
    return storage._cdata


def op_schema(func: torch._ops.OpOverload) -> torch._C.FunctionSchema:
    """``func._schema``: an ATen operator's schema (its arguments and which of them it writes);
    ``OpOverload`` exposes no public accessor. torch 2.13."""
    return func._schema


def flop_formulas() -> dict[Any, Any]:
    """torch's FLOP formulas by ATen operator packet, each called ``formula(*args, **kwargs,
    out_val=out)`` as ``FlopCounterMode`` calls them: ``torch.utils.flop_counter.flop_registry``,
    which the module does not list as public. torch 2.13."""
    from torch.utils.flop_counter import flop_registry

    return flop_registry


def in_autograd_engine() -> bool:
    """Whether this thread is running autograd's engine (a backward's nodes, or a checkpoint's
    recomputation inside one) rather than the Python that starts it: ``_current_graph_task_id()``
    is -1 outside. torch 2.13."""
    return torch._C._current_graph_task_id() != -1


def flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, is_causal: bool,
                    scale: float) -> torch.Tensor:  # fmt: skip
    """The output of ``aten._scaled_dot_product_flash_attention``: the flash kernel SDPA dispatches
    to on a GPU, here called directly, since SDPA itself takes its math path on meta (the op has
    a meta kernel, an autograd formula saving q, k, v, the output and the log-sum-exp, FLOP formulas,
    and takes fewer key/value heads than query heads). torch 2.13."""
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, is_causal, scale=scale)[0]


def foreach_mul_(tensors: list[torch.Tensor], scalar: float | torch.Tensor) -> None:
    """``torch._foreach_mul_``: multiply every tensor in place in one fused call, as
    ``clip_grad_norm_`` does internally (a Python loop launches a kernel per tensor). torch 2.13."""
    torch._foreach_mul_(tensors, scalar)


def allocation_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """``(start_ns, alloc_size, total_allocated)`` of each CPU allocation (``alloc_size < 0``: a
    free) a ``profile(profile_memory=True)`` recorded. Read from the experimental event tree of
    its kineto results, whose node tags are ``torch._C._profiler._EventType``; the public
    ``key_averages()`` sums allocations per operator and loses the running total. torch 2.13."""
    events, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
    return events
