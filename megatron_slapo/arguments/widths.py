"""The widths tensor parallelism splits, and the flag to blame when one does not split.

Every rank holds an equal share of the heads, key/value heads and FFN features (an MoE model's
experts' too), so the TP size must divide them. A model built from the size flags has widths no
flag gave directly (the FFN's is 4 x ``--hidden-size`` without ``--ffn-hidden-size``; an MoE
family's experts are that scaled as the family scales them): their errors name the flag that set
them and the one that sets them directly (:class:`Derived`), not a number the user never wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import transformers

from megatron_slapo.errors import ConfigError

# check_divisible's names of the widths the size flags may set only indirectly
FFN, EXPERTS, SHARED_EXPERTS = "FFN hidden size", "experts' FFN hidden size", "shared experts' FFN hidden size"


@dataclass(frozen=True)
class Derived:
    """A width of a config of the size flags that no flag gave directly, for the error that blames
    the flag behind it (:func:`check_divisible`): ``source`` set it (``--hidden-size 64``), ``how``
    (``4 x it``), and ``flag`` would give it directly (``--ffn-hidden-size``)."""

    source: str
    how: str
    flag: str


def check_divisible(
    config: transformers.PretrainedConfig,
    tp: int,
    shared_kv_heads: bool = False,
    derived: Mapping[str, Derived] | None = None,
) -> None:
    """Heads, key/value heads and FFN widths (the experts' too) must split evenly across the TP ranks;
    with ``shared_kv_heads`` (``--schedule auto``) the TP size may instead be a multiple of the
    key/value heads, each then shared by several ranks, as Megatron allows. One error names every
    width that does not split; one in ``derived`` (set by the size flags indirectly) is blamed on the
    flag that set it, with the flag that sets it directly."""
    sizes = {
        "attention heads": getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None),
        "key/value heads": getattr(config, "num_key_value_heads", None),
        FFN: getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        or getattr(config, "ffn_dim", None) or getattr(config, "d_ff", None),
        EXPERTS: getattr(config, "moe_intermediate_size", None),
        SHARED_EXPERTS: getattr(config, "shared_expert_intermediate_size", None),
    }  # fmt: skip
    kv = sizes["key/value heads"]
    if shared_kv_heads and kv and tp % kv == 0:
        del sizes["key/value heads"]
    problems = []
    for what, size in sizes.items():
        if not size or size % tp == 0:
            continue
        if derived and what in derived:
            d = derived[what]
            problems.append(f"{d.source} gives the {what} {size} ({d.how}), which --tensor-model-parallel-size {tp} "
                            f"does not divide: give {d.flag} (a multiple of {tp})")  # fmt: skip
        else:
            also = " (nor is it a multiple of them)" if shared_kv_heads and what == "key/value heads" else ""
            problems.append(f"--tensor-model-parallel-size {tp} does not divide the {size} {what}{also}")
    if problems:
        raise ConfigError("; ".join(problems))
