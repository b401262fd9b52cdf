"""The guard on every traced level: calls in the original signature, refused if not traced for.

A traced graph is specialised to its input shapes and dtypes, to the constant arguments baked in
at trace time, and possibly to train mode. :class:`CallGuard` accepts a call the way the original
module was called, checks all of that, and hands the graph its tensor inputs, so a mismatch is an
error rather than a silently wrong result.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn


class TraceError(RuntimeError):
    """A module could not be traced, or a traced graph was called with what it was not traced for."""


def forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature of the module's (unwrapped) forward, without its first (self) parameter."""
    sig = inspect.signature(inspect.unwrap(type(module).forward))
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def describe(value: Any) -> Any:
    """Shape and dtype of a tensor (recursively for tuples); ``None`` for anything else."""
    if isinstance(value, (tuple, list)):
        return tuple(describe(v) for v in value)
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def _same(value: Any, expected: Any) -> bool:
    if value is expected:
        return True
    if isinstance(value, torch.Tensor) or isinstance(expected, torch.Tensor) or type(value) is not type(expected):
        return False
    try:
        return bool(value == expected)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return False


def _fmt(desc: Any) -> str:
    if isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[1], torch.dtype):
        return f"shape {desc[0]} ({str(desc[1]).removeprefix('torch.')})"
    return "(" + ", ".join(_fmt(d) for d in desc) + ")" if isinstance(desc, tuple) else repr(desc)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value)[:60]


class CallGuard:
    """Forward pre-hook of every traced GraphModule (see the module docstring)."""

    def __init__(self, path: str, module: nn.Module, call: Call) -> None:
        self.path = path or "<root>"
        self.signature = forward_signature(module)
        params = self.signature.parameters
        self.var_kwargs = next((n for n, p in params.items() if p.kind == p.VAR_KEYWORD), None)
        self.inputs = {name: describe(value) for name, value in call.tensors.items()}
        self.constants = dict(call.constants)
        # Baked-in values that a caller leaving the argument out would not get by default.
        self.required = {
            name: value for name, value in self.constants.items()
            if name not in params or not _same(value, params[name].default)
        }  # fmt: skip

    def _error(self, message: str) -> TraceError:
        return TraceError(f"[{self.path}] {message}")

    def __call__(self, module: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module.meta.get("slapo_train_only") and not module.training:
            raise self._error(
                "its traced graph depends on train/eval mode beyond dropout and was traced in train mode; "
                "call it in train mode, or keep this module a leaf when tracing"
            )
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise self._error(f"called with arguments its traced graph does not take: {e}") from e
        given = {**{k: v for k, v in bound.items() if k != self.var_kwargs}, **bound.get(self.var_kwargs, {})}
        inputs = {}
        for name, value in given.items():
            if name in self.inputs:
                if describe(value) != self.inputs[name]:
                    raise self._error(
                        f"was traced for {name} of {_fmt(self.inputs[name])} and called with {_fmt(describe(value))}; "
                        "trace again with example inputs like these"
                    )
                inputs[name] = value
                continue
            parameter = self.signature.parameters.get(name)
            expected = self.constants.get(name, parameter.default if parameter is not None else None)
            if expected is inspect.Parameter.empty or not _same(value, expected):
                raise self._error(
                    f"was traced with {name}={expected!r} baked in and called with {name}={_short(value)}; trace "
                    "with it as an example input (tensors) or in concrete_args (constants)"
                )
        missing = [n for n in self.inputs if n not in inputs] + [n for n in self.required if n not in given]
        if missing:
            raise self._error(f"traced with {sorted(missing)} given; call it with them too")
        return (), inputs


@dataclass
class Call:
    """How a module is called: tensor inputs (by parameter name) and constant arguments.

    ``tensors`` maps an input name to a tensor, or to a tuple of tensors (Llama's
    ``position_embeddings=(cos, sin)``); ``sources`` holds, for a call recorded in a parent graph,
    the parent's fx nodes that feed each input.
    """

    tensors: dict[str, Any]
    constants: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)

    def flat_inputs(self) -> list[tuple[str, torch.Tensor]]:
        """Placeholder names and tensors, tuples flattened as ``name_0``, ``name_1`` ..."""
        flat = []
        for name, value in self.tensors.items():
            if isinstance(value, (tuple, list)):
                flat.extend((f"{name}_{i}", v) for i, v in enumerate(value))
            else:
                flat.append((name, value))
        return flat
