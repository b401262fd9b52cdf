"""The tracer: one ``GraphModule`` per level of the module tree, child levels traced recursively.

See :mod:`megatron_slapo.tracing` for the approach.
"""

from __future__ import annotations

import copy
import itertools
import operator
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental import meta_tracer
from torch.fx.experimental.meta_tracer import MetaTracer
from transformers import activations as hf_activations
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput

from megatron_slapo.compat.fx import has_tensor_meta, module_call_unpatched, module_getattr_disabled, rename_node
from megatron_slapo.compat.torch_internals import view_base
from megatron_slapo.compat.transformers_internals import copy_init_weights
from megatron_slapo.tracing.guard import Call, CallGuard, TraceError, forward_signature
from megatron_slapo.tracing.meta_fixes import (
    all_metas,
    evaluate_on_meta,
    experts_on_meta,
    has_real_tensor,
    meta_tracer_fixes,
    metas,
)
from megatron_slapo.tracing.module_shape import graph_module

ORIGINAL = "slapo_original"  # GraphModule.meta key: the module a level was traced from, if it had meta tensors
# Layers that stay one node, besides every module defined in torch.nn (fx's default): HF's Conv1D
# and HF's activation modules (so that find() can match them against F.gelu and friends).
LEAF_TYPES: tuple[type[nn.Module], ...] = (Conv1D,) + tuple(
    cls for cls in vars(hf_activations).values() if isinstance(cls, type) and issubclass(cls, nn.Module)
)


def _is_tensor_like(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, fx.Proxy, fx.Node)):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(_is_tensor_like(v) for v in value)


def bind_call(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map a call's positional and keyword arguments onto the module's forward parameter names."""
    params = list(forward_signature(module).parameters.values())
    bound: dict[str, Any] = {}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional):
        raise TraceError(
            f"{type(module).__name__}.forward got {len(args)} positional arguments; *args are not traceable"
        )
    for p, value in zip(positional, args, strict=False):
        bound[p.name] = value
    bound.update(kwargs)
    return bound


def make_call(module: nn.Module, args: tuple, kwargs: dict, sources: dict | None = None) -> Call:
    """Split a call into traced tensor inputs and baked-in constants."""
    tensors, constants = {}, {}
    for name, value in bind_call(module, args, kwargs).items():
        (tensors if _is_tensor_like(value) else constants)[name] = value
    return Call(tensors, constants, sources or {})


def _wrapper(module: nn.Module, call: Call) -> nn.Module:
    """A module whose forward has one named parameter per tensor input and calls ``module``."""
    parts = []
    for name, value in call.tensors.items():
        if isinstance(value, (tuple, list)):
            parts.append(f"{name}=({', '.join(f'{name}_{i}' for i in range(len(value)))},)")
        else:
            parts.append(f"{name}={name}")
    names = [n for n, _ in call.flat_inputs()]
    src = (
        f"def forward(self, {', '.join(names)}):\n"
        f"    out = self.inner({', '.join(parts)}, **self.constants)\n"
        f"    self.__dict__['out_type'] = type(out)\n"
        f"    self.__dict__['out'] = out\n"
        f"    return out\n"
    )
    namespace: dict[str, Any] = {}
    exec(src, namespace)
    cls = type(f"Traced{type(module).__name__}", (nn.Module,), {"forward": namespace["forward"]})
    wrapper = cls()
    wrapper.inner = module
    wrapper.constants = dict(call.constants)
    return wrapper


def is_builtin_leaf(module: nn.Module) -> bool:
    """Layers fx keeps as one op: modules defined in torch.nn (not containers) and HF's Conv1D.
    Modules marked ``slapo_inline`` (decomposed layers) are always traced through."""
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or getattr(module, "slapo_inline", False):
        return False
    return isinstance(module, LEAF_TYPES) or type(module).__module__.startswith("torch.nn.")


def level_children(module: nn.Module) -> set[str]:
    """Qualified names of the modules that are children of this level (looking through ModuleLists;
    modules marked ``slapo_inline`` are part of this level's graph instead)."""
    names = set()
    for name, child in module.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            names |= {f"{name}.{n}" for n in level_children(child)}
        elif not getattr(child, "slapo_inline", False):
            names.add(name)
    return names


def _to_meta(value: Any) -> Any:
    """The meta tensors behind a (possibly nested) traced output, containers and ModelOutputs kept."""
    if isinstance(value, fx.Proxy):
        return metas(value)
    if isinstance(value, ModelOutput):
        return type(value)(**{k: _to_meta(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


class _Tracer(MetaTracer):
    """MetaTracer for one level: leaf layers are evaluated on a meta copy; child levels are traced
    (recursively) and their traced output shapes used, so no child runs eagerly on meta tensors
    (HF mask code, for one, calls ``.item()`` when it is not being traced). Buffers are read in the
    graph (``get_attr``) rather than at trace time, so what is computed from them (BERT's
    ``token_type_ids`` gathered by position) is recomputed from their values when the graph runs."""

    proxy_buffer_attributes = True

    def __init__(self, module: nn.Module, path: str, flatten: bool, user_leaves: tuple[type, ...]) -> None:
        super().__init__()
        self.module, self.path, self.flatten, self.user_leaves = module, path, flatten, user_leaves
        self.levels = set() if flatten else level_children(module)
        self.children: dict[str, Traced] = {}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname == "inner" or not qualname.startswith("inner."):
            return False
        return is_builtin_leaf(m) or isinstance(m, self.user_leaves) or qualname[len("inner.") :] in self.levels

    def trace(self, root: nn.Module, meta_args: dict, concrete_args: dict | None = None) -> fx.Graph:
        self.meta_root = meta_copy(root)
        return super().trace(root, meta_args, concrete_args)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """Branches on static metadata (``mask.ndim == 2``) are decided now, from the example inputs'
        metas: the graph is specialised to their shapes anyway. Data-dependent ones still fail."""
        try:
            meta = metas(obj) if isinstance(obj, meta_tracer.MetaProxy) else None
        except AttributeError:  # no meta was computed for it
            meta = None
        if isinstance(meta, (bool, int)):
            return bool(meta)
        return super().to_bool(obj)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind in ("call_function", "call_method") and has_real_tensor((args, kwargs)):
            return self._create_mixed_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind != "call_module":
            return super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        proxy = fx.Tracer.create_proxy(self, kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        qualname = target[len("inner.") :]
        meta_args, meta_kwargs = fx.node.map_aggregate((args, kwargs), metas)
        child = self.module.get_submodule(qualname)
        if qualname in self.levels and not is_builtin_leaf(child) and not isinstance(child, self.user_leaves):
            call = make_call(child, meta_args, meta_kwargs)
            call.sources = bind_call(child, *fx.node.map_aggregate((args, kwargs), _node_of))
            child_path = f"{self.path}.{qualname}" if self.path else qualname
            with module_getattr_disabled(self):  # the nested tracer copies modules: keep ours out of it
                self.children[qualname] = trace_level(child, call, child_path, self.flatten, self.user_leaves)
            proxy.install_tensor_meta(self.children[qualname].output_meta)
        else:
            meta_args, meta_kwargs = fx.node.map_aggregate((meta_args, meta_kwargs), all_metas)  # weights are meta
            proxy.install_tensor_meta(self._run_on_meta(target, meta_args, meta_kwargs))
        return proxy

    def _create_mixed_proxy(self, kind, target, args, kwargs, name, type_expr, proxy_factory_fn) -> fx.Proxy:
        """An op on proxies *and* real tensors (a real module's buffer, as in GPT-Neo's
        ``torch.where(self.bias[...], attn_weights, mask_value)``). MetaTracer evaluates it with the real
        tensors as they are, which works when their values matter (indexing with a real mask) but fails
        when they meet meta tensors; then the op is evaluated again with the real tensors on meta."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if not has_tensor_meta(proxy):
            try:
                meta = evaluate_on_meta(kind, target, args, kwargs)
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                pass
            else:
                proxy.install_tensor_meta(meta)
                caught = []
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return proxy

    def _run_on_meta(self, target: str, args: tuple, kwargs: dict) -> Any:
        # fx has patched Module.__call__ to record calls; a leaf that calls its own children needs it back.
        with module_getattr_disabled(self), module_call_unpatched():
            leaf = self.meta_root.get_submodule(target)
            with experts_on_meta(leaf):
                return leaf(*args, **kwargs)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with meta tensors in place of its weights (no weight memory is copied)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _node_of(value: Any) -> Any:
    return value.node if isinstance(value, fx.Proxy) else value


def _regroup_tuple_inputs(graph: fx.Graph, call: Call) -> dict[fx.Node, fx.Node]:
    """Turn the flattened ``name_0, name_1`` placeholders of a tuple input back into one ``name``;
    return which node now stands for each removed placeholder."""
    placeholders = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    moved: dict[fx.Node, fx.Node] = {}
    for name, value in call.tensors.items():
        if not isinstance(value, (tuple, list)):
            continue
        parts = [placeholders[f"{name}_{i}"] for i in range(len(value))]
        with graph.inserting_before(parts[0]):
            grouped = graph.placeholder(name)
        with graph.inserting_after(parts[-1]):
            for i, part in enumerate(parts):
                item = graph.call_function(operator.getitem, (grouped, i))
                part.replace_all_uses_with(item)
                graph.erase_node(part)
                moved[part] = item
    return moved


def _views_of_buffers(graph: fx.Graph, wrapper: nn.Module, module: nn.Module) -> None:
    """A buffer sliced with constant indices (BERT's ``self.position_ids[:, :seq]``) is evaluated
    during tracing and lifted as a constant tensor; a copy of a meta model's buffer has no values,
    and a real one would go stale. Such a constant becomes a strided view of the buffer again."""
    buffers = {id(b): name for name, b in module.named_buffers()}
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.target.startswith("inner."):
            continue
        value = getattr(wrapper, node.target)
        name = buffers.get(id(view_base(value)))
        if name is None:
            continue
        with graph.inserting_before(node):
            base = graph.get_attr(f"inner.{name}")
            view = graph.call_function(
                torch.as_strided, (base, tuple(value.shape), tuple(value.stride()), value.storage_offset())
            )
        node.replace_all_uses_with(view)
        graph.erase_node(node)


def _strip_prefix(graph: fx.Graph) -> None:
    """Targets and names were recorded under the tracing wrapper's ``inner`` attribute."""
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(node.target, str) and node.target.startswith("inner."):
            node.target = node.target[len("inner.") :]
        if node.name.startswith("inner_") and node.name != "inner_self":  # "self" would shadow the module
            rename_node(node, node.name[len("inner_") :])


def _rebuild_model_output(graph: fx.Graph, out_type: type) -> None:
    if not (isinstance(out_type, type) and issubclass(out_type, ModelOutput)):
        return
    output = next(n for n in graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, dict):
        with graph.inserting_before(output):
            rebuilt = graph.call_function(out_type, (), dict(value))
        output.args = (rebuilt,)


def _failure(path: str, module: nn.Module, err: BaseException) -> TraceError:
    """Name the module and the source line (outside torch.fx) where tracing broke."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/fx/" not in f.filename
              and not f.filename.endswith("megatron_slapo/tracing/tracer.py")]  # fmt: skip
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {f.filename.split('site-packages/')[-1]}:{f.lineno} `{(f.line or '').strip()}`"
    return TraceError(
        f"[{path or '<root>'}] cannot trace {type(module).__name__}: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}{where}. Keep it a leaf (leaf_modules=...) "
        "or give the failing argument as a constant (concrete_args=...)"
    )


@dataclass
class Traced:
    """One traced level: its GraphModule, the traced child levels, and its output as meta tensors."""

    module: fx.GraphModule
    call: Call
    children: dict[str, Traced]
    output_meta: Any


def trace_level(
    module: nn.Module, call: Call, path: str = "", flatten: bool = False, user_leaves: tuple[type, ...] = ()
) -> Traced:
    """Trace ``module`` for ``call``; child levels are traced too (see :func:`install`)."""
    wrapper = _wrapper(module, call)
    tracer = _Tracer(module, path, flatten, tuple(user_leaves))
    metas = {name: t.to("meta") for name, t in call.flat_inputs()}
    try:
        with meta_tracer_fixes(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="transformers")  # HF's tracing-time advice
            graph = tracer.trace(wrapper, metas)
    except TraceError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure inside user/HF code is reported the same way
        raise _failure(path, module, err) from err
    _views_of_buffers(graph, wrapper, module)
    constants = {
        n.target: getattr(wrapper, n.target)
        for n in graph.nodes
        if n.op == "get_attr" and not n.target.startswith("inner.")  # tensors fx lifted onto the wrapper
    }
    _strip_prefix(graph)
    moved = _regroup_tuple_inputs(graph, call)
    for child in tracer.children.values():
        child.call.sources = fx.node.map_arg(child.call.sources, lambda n: moved.get(n, n))
    _rebuild_model_output(graph, wrapper.__dict__.get("out_type"))
    gm = graph_module(module, graph, constants)
    copy_init_weights(module, gm)  # an HF model's initialiser: build() still needs it for new weights
    if any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        gm.meta[ORIGINAL] = module  # build() initialises as the untraced module would (megatron_slapo/init_tree.py)
    gm.train(module.training)
    gm.register_forward_pre_hook(CallGuard(path, module, call), with_kwargs=True)
    return Traced(gm, call, tracer.children, _to_meta(wrapper.__dict__.get("out")))


def install(traced: Traced, recursive: bool = True) -> fx.GraphModule:
    """Put each traced child level into its parent's GraphModule, calling it with its tensor inputs
    (``recursive=False`` leaves the children as the original modules)."""
    gm = traced.module
    for qualname, child in traced.children.items() if recursive else ():
        install(child)
        parent_name, _, leaf = qualname.rpartition(".")
        setattr(gm.get_submodule(parent_name) if parent_name else gm, leaf, child.module)
        for node in gm.graph.nodes:
            if node.op == "call_module" and node.target == qualname:
                node.args = ()  # the guard checks the baked constants and passes the tensors on
                node.kwargs = {**child.call.constants, **{n: child.call.sources[n] for n in child.call.tensors}}
    gm.recompile()
    return gm
