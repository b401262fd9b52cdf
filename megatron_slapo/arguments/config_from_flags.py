"""The HF config that Megatron's size flags describe (``--num-layers``, ``--hidden-size``, ...), when
no ``--hf-config`` / ``--load-hf`` gives one.

Megatron's own families (GPT-2, GPT-Neo, OPT, Llama, BERT, T5) take the flags as Megatron builds
them; any other transformers model type takes its config class's defaults scaled down to the flags,
and an MoE family takes Megatron's MoE flags. Widths the flags set only indirectly (an FFN from
``--hidden-size``, experts' widths scaled as the family scales them) are returned with the flag
they came from (:class:`~megatron_slapo.arguments.widths.Derived`), so that a width TP cannot split
is blamed on that flag.
"""

from __future__ import annotations

import argparse
from typing import Any

import transformers

from megatron_slapo.arguments.family_flags import SCALED_DOWN_FIELDS
from megatron_slapo.arguments.validation import flag
from megatron_slapo.arguments.widths import EXPERTS, FFN, SHARED_EXPERTS, Derived
from megatron_slapo.errors import ConfigError

# --model-type -> HF config class (the model class follows from the task, see auto_class)
CONFIGS = {
    "gpt2": "GPT2Config", "gpt_neo": "GPTNeoConfig", "opt": "OPTConfig", "llama": "LlamaConfig",
    "bert": "BertConfig", "roberta": "RobertaConfig", "albert": "AlbertConfig", "t5": "T5Config",
}  # fmt: skip


def config_from_flags(
    args: argparse.Namespace, vocab: int, tokenizer: Any
) -> tuple[transformers.PretrainedConfig, dict[str, Derived]]:
    """The config Megatron's size flags describe (validate_args has checked that they are given and
    fit), and its widths that they set only indirectly, by their :func:`check_divisible` names."""
    if args.model_type in CONFIGS:
        return _megatron_family(args, vocab, tokenizer), _ffn_of_width(args)
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    return _scaled_down(args.model_type, args, vocab, ffn, getattr(tokenizer, "eod", None))


def _ffn_of_width(args: argparse.Namespace) -> dict[str, Derived]:
    """The FFN width, when ``--ffn-hidden-size`` does not give it: Megatron's 4 x ``--hidden-size``
    (Llama's 8/3 x it, to the next multiple of 64)."""
    if args.ffn_hidden_size:
        return {}
    how = "8/3 x it, to the next multiple of 64" if args.model_type == "llama" else "4 x it"
    return {FFN: Derived(flag(args, "hidden_size"), f"{how}, without --ffn-hidden-size", "--ffn-hidden-size")}


def _megatron_family(args: argparse.Namespace, vocab: int, tokenizer: Any) -> transformers.PretrainedConfig:
    """The config of one of Megatron's own model types (:data:`CONFIGS`), from the size flags."""
    L, h, a, s = args.num_layers, args.hidden_size, args.num_attention_heads, args.max_position_embeddings
    ffn = args.ffn_hidden_size or 4 * h
    hd, ad, std = args.hidden_dropout, args.attention_dropout, args.init_method_std
    eod = getattr(tokenizer, "eod", None)
    kind = args.model_type
    cls = getattr(transformers, CONFIGS[kind])
    if kind == "gpt2":
        return cls(vocab_size=vocab, n_positions=s, n_embd=h, n_layer=L, n_head=a, n_inner=ffn, resid_pdrop=hd,
                   embd_pdrop=hd, attn_pdrop=ad, initializer_range=std, bos_token_id=eod, eos_token_id=eod)  # fmt: skip
    if kind == "gpt_neo":
        return cls(vocab_size=vocab, max_position_embeddings=s, hidden_size=h, num_layers=L, num_heads=a,
                   intermediate_size=ffn, attention_types=[[["global"], L]], resid_dropout=hd, embed_dropout=hd,
                   attention_dropout=ad, initializer_range=std, bos_token_id=eod, eos_token_id=eod)  # fmt: skip
    if kind == "opt":
        return cls(vocab_size=vocab, max_position_embeddings=s, hidden_size=h, num_hidden_layers=L, ffn_dim=ffn,
                   num_attention_heads=a, word_embed_proj_dim=h, dropout=hd, attention_dropout=ad, init_std=std,
                   bos_token_id=eod, eos_token_id=eod, pad_token_id=eod)  # fmt: skip
    if kind == "llama":
        return cls(vocab_size=vocab, max_position_embeddings=s, hidden_size=h, num_hidden_layers=L,
                   intermediate_size=args.ffn_hidden_size or int(8 * h / 3 / 64 + 1) * 64, num_attention_heads=a,
                   num_key_value_heads=args.num_query_groups or a, attention_dropout=ad, initializer_range=std,
                   bos_token_id=eod, eos_token_id=eod, tie_word_embeddings=False)  # fmt: skip
    if kind == "t5":  # T5 v1.0's shape (ReLU FFN, tied head), as Megatron's T5; the decoder as deep as the encoder
        return cls(vocab_size=vocab, d_model=h, d_kv=h // a, d_ff=ffn, num_layers=L, num_decoder_layers=L, num_heads=a,
                   dropout_rate=hd, feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=tokenizer.pad,
                   eos_token_id=tokenizer.eos, decoder_start_token_id=tokenizer.bos)  # fmt: skip
    common = dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=L, num_attention_heads=a, intermediate_size=ffn,
                  max_position_embeddings=s, hidden_dropout_prob=hd, attention_probs_dropout_prob=ad,
                  initializer_range=std, pad_token_id=getattr(tokenizer, "pad", 0))  # fmt: skip
    if kind == "albert":
        common["embedding_size"] = min(128, h)
    if kind == "roberta":
        common["max_position_embeddings"] = s + 2  # RoBERTa offsets positions by padding_idx + 1
    return cls(**common)


def _scaled_down(
    kind: str, args: argparse.Namespace, vocab: int, ffn: int, eod: int | None
) -> tuple[transformers.PretrainedConfig, dict[str, Derived]]:
    """Any other transformers model type: its config class's defaults, with the size flags in its
    standard fields (``hidden_size``, ``num_hidden_layers``, ... or their aliases), and the optional
    ones (FFN width, key/value heads, dropout, init: :data:`SCALED_DOWN_FIELDS`) where it has them
    (validation refuses one given for a family without its field). No padding id: the
    end-of-document token must keep its embedding's gradient. Returned with the widths it derived
    (the FFN's, when the family takes ``intermediate_size``; the experts', :func:`_set_experts`)."""
    cls = transformers.CONFIG_MAPPING[kind]
    default = cls()
    if getattr(default, "sub_configs", None):
        raise ConfigError(f"--model-type {kind} is a composite model ({', '.join(default.sub_configs)}): give its "
                          "text model's type, or --hf-config")  # fmt: skip
    sizes = dict(
        vocab_size=vocab,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        max_position_embeddings=args.max_position_embeddings,
    )
    missing = [k for k in sizes if not hasattr(default, k)]  # attribute_map aliases count
    if missing:
        raise ConfigError(f"--model-type {kind}: its config has no {', '.join(missing)} to take the size flags; "
                          "give --hf-config instead")  # fmt: skip
    flags = dict(vars(args), ffn_hidden_size=ffn, num_query_groups=args.num_query_groups or args.num_attention_heads)
    optional = {field: flags[name] for name, field in SCALED_DOWN_FIELDS.items()}
    optional.update(bos_token_id=eod, eos_token_id=eod)
    config = cls(**sizes, **{k: v for k, v in optional.items() if hasattr(default, k)})
    if getattr(config, "pad_token_id", None) is not None:  # a default's id may even lie beyond the vocabulary
        config.pad_token_id = None
    computed = isinstance(getattr(cls, "head_dim", None), property)  # Falcon's: the width / the heads already
    if hasattr(config, "head_dim") and not computed and not getattr(config, "qk_rope_head_dim", None):
        # derived from the width, not the default's (multi-head latent attention's head_dim is its rotary part);
        # a default of None too, which some families' attention cannot derive (hunyuan_v1_dense's)
        config.head_dim = args.hidden_size // args.num_attention_heads
    derived = _ffn_of_width(args) if hasattr(default, "intermediate_size") else {}  # else the family's own
    return config, {**derived, **_set_experts(config, default, args, ffn)}


# Megatron's MoE flags -> the config fields (or attribute_map aliases) that families name them by
_MOE_FIELDS = {
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
}


def _field(config: transformers.PretrainedConfig, flag: str) -> str | None:
    return next((f for f in _MOE_FIELDS[flag] if hasattr(config, f)), None)


def _set_experts(
    config: transformers.PretrainedConfig, default: transformers.PretrainedConfig, args: argparse.Namespace, ffn: int
) -> dict[str, Derived]:
    """The MoE flags into an MoE family's config. The family's expert count is sized for its full
    model, so ``--num-experts`` is required (Megatron's models have none without it); top-k is the
    family's (at most the experts), and the experts' widths are ``--ffn-hidden-size`` scaled as the
    family scales them (returned, :class:`Derived`, unless their flags gave them). A flag a family
    has no field for is refused rather than ignored."""
    count = _field(config, "num_experts")
    for name in _MOE_FIELDS:
        if getattr(args, name) is not None and _field(config, name) is None:
            hint = " (its experts are --ffn-hidden-size wide)" if count and name == "moe_ffn_hidden_size" else ""
            raise ConfigError(f"--{name.replace('_', '-')}: the {config.model_type} config has no "
                              f"{' or '.join(_MOE_FIELDS[name])} to take it{hint}")  # fmt: skip
    if count is None:
        return {}
    if args.num_experts is None:
        raise ConfigError(f"--model-type {config.model_type} is a mixture of experts: give --num-experts (the "
                          f"family's {getattr(config, count)} are sized for its full model)")  # fmt: skip
    family_ffn = getattr(default, "intermediate_size", None)
    family_top_k = getattr(config, "num_experts_per_tok", 1)
    if args.moe_router_topk is None and family_top_k is None:
        raise ConfigError(f"--model-type {config.model_type} has no default number of experts per token: give "
                          "--moe-router-topk")  # fmt: skip
    top_k = args.moe_router_topk or min(family_top_k, args.num_experts)
    if top_k > args.num_experts:
        raise ConfigError(f"--moe-router-topk {top_k} exceeds --num-experts {args.num_experts}")
    groups = getattr(config, "n_group", None)
    if groups and (args.num_experts % groups or args.num_experts // groups < 2):
        raise ConfigError(f"--num-experts {args.num_experts}: {config.model_type} routes within {groups} groups of "
                          f"experts (n_group), each of 2 or more: give a multiple of {2 * groups}, or --hf-config")  # fmt: skip
    if hasattr(config, "n_shared_experts") and config.n_shared_experts is None:
        raise ConfigError(f"--model-type {config.model_type}: its config's default has no shared-expert count "
                          "(n_shared_experts) to build from the size flags; give --hf-config")  # fmt: skip
    setattr(config, count, args.num_experts)
    config.num_experts_per_tok = top_k
    source = flag(args, "ffn_hidden_size") if args.ffn_hidden_size else flag(args, "hidden_size")
    base = "" if args.ffn_hidden_size else f"4 x it = {ffn} without --ffn-hidden-size"
    derived = {}
    for what, name in ((EXPERTS, "moe_ffn_hidden_size"), (SHARED_EXPERTS, "moe_shared_expert_intermediate_size")):
        field, given = _field(config, name), getattr(args, name)
        if field is None:
            continue
        scaled = ffn * getattr(default, field) // family_ffn if family_ffn else ffn
        setattr(config, field, given or max(1, scaled))
        if not given:
            scale = (
                f"x {getattr(default, field)} / {family_ffn}: {config.model_type}'s proportions" if family_ffn else ""
            )
            how = ", ".join(part for part in (base, scale) if part) or "as wide as the FFN"
            derived[what] = Derived(source, how, f"--{name.replace('_', '-')}")
    return derived
