"""transformers' private names: configs' implementation fields, models' initialiser and its flag,
attention and experts internals, and the packed-sequence search of ``masking_utils``.

Written against transformers 5.x (5.0 to 5.24).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def attn_implementation(config: PretrainedConfig) -> str | None:
    """``config._attn_implementation``: the name of the attention function the model's modules call
    (and which decides the form of its masks); transformers has no public getter. transformers 5.x."""
    return config._attn_implementation


def set_attn_implementation(config: PretrainedConfig, name: str) -> None:
    """Set ``config._attn_implementation`` to a registered attention function's ``name``, on this
    config alone: ``PreTrainedModel.set_attn_implementation`` changes every config of a model (and
    the mask format with them). transformers 5.x."""
    config._attn_implementation = name


@contextlib.contextmanager
def experts_implementation(configs: Iterable[PretrainedConfig], name: str) -> Iterator[None]:
    """Inside, MoE experts with these configs run the ``name`` implementation (``"batched_mm"``,
    ``"grouped_mm"``, ``"eager"``): ``config._experts_implementation``, which they read at each call,
    restored after. Setting it per model is public only at load time. transformers 5.x."""
    configs = list(configs)
    before = [config._experts_implementation for config in configs]
    for config in configs:
        config._experts_implementation = name
    try:
        yield
    finally:
        for config, previous in zip(configs, before, strict=True):
            config._experts_implementation = previous


def has_default_experts_gate(experts_class: type) -> bool:
    """Whether an HF experts class splits its packed ``gate_up_proj`` output as transformers does
    (``chunk(2)``: the gate half, then the up half): its ``_apply_gate`` is ``moe._default_apply_gate``,
    which ``use_experts_implementation`` installs on classes without their own. transformers 5.x."""
    gate = getattr(experts_class, "_apply_gate", None)
    return gate is None or gate.__name__ == "_default_apply_gate"


def grouped_experts_forward(experts: nn.Module, rows: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """transformers' grouped-GEMM experts forward (``grouped_mm_experts_forward``: one
    ``torch.nn.functional.grouped_mm`` per projection over all the experts) when torch offers that
    GEMM for ``rows`` and the experts' weights, else None. transformers 5.x's own test
    (``moe._can_use_grouped_mm``), and on the CPU the kernel's alignment rule (every row 16-byte
    aligned), which that test does not check."""
    from transformers.integrations import moe

    weights = [getattr(experts, name) for name in ("gate_up_proj", "down_proj")]
    offsets = torch.zeros(weights[0].size(0), dtype=torch.int32, device=rows.device)
    if not moe._can_use_grouped_mm(rows, weights[0], offsets):
        return None
    widths = [rows.size(-1), *(w.size(d) for w in weights for d in (-1, -2))]
    if rows.device.type == "cpu" and any(n * rows.element_size() % 16 for n in widths):
        return None
    return moe.grouped_mm_experts_forward


def apply_experts_gate(experts: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """An HF experts module's activation of its packed gate|up output (``_apply_gate``, which
    ``use_experts_implementation`` installs). transformers 5.x."""
    return experts._apply_gate(gate_up)


@contextlib.contextmanager
def unpacked_on_meta() -> Iterator[None]:
    """HF's masks look for packed sequences in ``position_ids`` (positions that restart) and branch
    on the answer, which a meta tensor cannot give. On meta, sequences are taken as unpacked: the
    mask then has the shape it has for the trainer's batches (one sequence a row, or a 4D mask of
    documents given explicitly, which skips the search). Patches ``masking_utils``'
    ``find_packed_sequence_indices``, which the mask functions look up in their module at each
    call; it has no switch. transformers 5.x."""
    from transformers import masking_utils

    search = masking_utils.find_packed_sequence_indices

    def unpacked_if_meta(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if position_ids.is_meta else search(position_ids)

    masking_utils.find_packed_sequence_indices = unpacked_if_meta
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = search


def calls_attn_method(module: nn.Module, names: Iterable[str]) -> bool:
    """Whether a forward that refers to ``names`` (its code's ``co_names``) runs its attention core
    in the class's own ``_attn`` method (GPT-Neo), a private method HF models define themselves
    instead of calling the attention interface. transformers 5.x."""
    return "_attn" in names and callable(getattr(type(module), "_attn", None))


def class_attn_method(cls: type) -> Callable[..., Any]:
    """The class's own ``_attn`` method (see :func:`calls_attn_method`). transformers 5.x."""
    return cls._attn


def set_attn_method(module: nn.Module, fn: Callable[..., Any]) -> None:
    """Make ``fn`` (called with the module first) this module's ``_attn`` (see :func:`calls_attn_method`);
    a method bound to the module, so a deep copy of the model rebinds it. transformers 5.x."""
    module._attn = types.MethodType(fn, module)


def has_init_weights(module: nn.Module) -> bool:
    """Whether ``module`` has an HF initialiser ``_init_weights(submodule)``: the per-module hook a
    ``PreTrainedModel`` defines (public ``init_weights()`` only initialises the whole model, and
    skips tensors already flagged). transformers 5.x."""
    return hasattr(module, "_init_weights")


def holds_init_weights(module: nn.Module) -> bool:
    """Whether ``module`` itself holds an initialiser, given by :func:`copy_init_weights` (a traced
    graph of an HF model) rather than inherited from its class. transformers 5.x."""
    return "_init_weights" in vars(module)


def copy_init_weights(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` the HF initialiser of ``source``, if it has one. transformers 5.x."""
    if has_init_weights(source):
        target._init_weights = source._init_weights


def init_weights(owner: nn.Module, module: nn.Module) -> None:
    """Initialise ``module``'s own tensors as the HF model ``owner`` would: ``owner._init_weights(module)``
    (see :func:`has_init_weights`). transformers 5.x."""
    owner._init_weights(module)


def is_hf_initialized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` carries ``_is_hf_initialized``, the flag with which HF's init functions
    (``transformers.initialization``) skip a tensor; they read no other. transformers 5.x."""
    return getattr(tensor, "_is_hf_initialized", False)


def mark_hf_initialized(tensor: torch.Tensor) -> None:
    """Flag ``tensor`` so that HF's init functions skip it (see :func:`is_hf_initialized`). transformers 5.x."""
    tensor._is_hf_initialized = True


def unmark_hf_initialized(tensor: torch.Tensor) -> None:
    """Remove the flag :func:`mark_hf_initialized` set. transformers 5.x."""
    del tensor._is_hf_initialized
