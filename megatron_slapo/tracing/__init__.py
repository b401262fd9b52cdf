"""Structure-preserving torch.fx tracing of transformers-5 modules.

transformers 5 removed its fx tracer, and plain ``torch.fx.symbolic_trace`` fails on HF attention
and decoder blocks (../shared/notes/cpu-feasibility.md §3). Three things make it work:

1. **An explicit signature.** HF forwards are ``(self, *args, **kwargs)`` wrappers; fx needs named
   inputs. We trace a generated wrapper ``forward(self, hidden_states, ...)`` that calls the module
   with those tensors plus the constant arguments (``use_cache=False``, ``None`` masks) baked in,
   which also removes the Python branches on optional inputs.
2. **Meta tensors for shapes.** ``(*x.shape[:-1], -1, head_dim)`` needs concrete sizes, so tracing
   propagates meta tensors (torch's ``MetaTracer``), evaluating leaf modules on a meta copy. The
   graph is therefore specialised to the traced input shapes; a guard refuses other shapes with a
   clear error instead of computing something wrong.
3. **One graph per level.** Every level of the module tree becomes its own ``GraphModule``: leaf
   layers (``nn.Linear``, HF ``Conv1D``, norms, dropout, ...) and child modules stay ``call_module``
   nodes, so ``sch["h.0.attn"]`` still addresses the attention module after tracing ``h.0``. The
   call of each child is recorded with its argument shapes, so children can be traced in turn.

HF ``ModelOutput`` return values are rebuilt as such (fx would flatten them into dicts), and each
``GraphModule`` keeps its module's shape (``module_shape.py``: layer lists, parameter names, buffer
persistence, child order), so tracing changes how a model runs, never what it looks like.
"""

from megatron_slapo.tracing.guard import Call, CallGuard, TraceError
from megatron_slapo.tracing.modes import trace_module
from megatron_slapo.tracing.tracer import LEAF_TYPES, Traced, is_builtin_leaf, make_call, meta_copy, trace_level

__all__ = [
    "Call", "CallGuard", "LEAF_TYPES", "TraceError", "Traced", "is_builtin_leaf", "make_call", "meta_copy",
    "trace_level", "trace_module",
]  # fmt: skip
