"""The HF model a run trains: from Megatron's size flags, an HF config, or pretrained weights.

The model is created on the meta device (``build`` gives each rank only its shards) unless
``--load-hf`` starts from real pretrained weights. The vocabulary is padded the way Megatron pads
it, to a multiple of ``--make-vocab-size-divisible-by`` x TP size, so that it shards evenly; the
padding is recorded so that export can drop it again.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from megatron_slapo.engines.base import ModelShape
from megatron_slapo.engines.optimizer import half_precision
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels import attention
from megatron_slapo.models.wideresnet import WideResNetConfig
from megatron_slapo.training import pretrained
from megatron_slapo.training.validation import default_model_type

# --model-type -> HF config class (the model class follows from the task, see auto_class)
CONFIGS = {
    "gpt2": "GPT2Config", "gpt_neo": "GPTNeoConfig", "opt": "OPTConfig", "llama": "LlamaConfig",
    "bert": "BertConfig", "roberta": "RobertaConfig", "albert": "AlbertConfig", "t5": "T5Config",
}  # fmt: skip


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padding: the next multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def hf_vocab_size(model_vocab: int, tokenizer_vocab: int, divisible_by: int, tensor_parallel: int) -> int:
    """Embedding rows of a model that starts from an HF config: the model's own rows if they cover
    the tokenizer's padded vocabulary and split evenly across TP, else Megatron's padding of them."""
    size = max(model_vocab, padded_vocab_size(tokenizer_vocab, divisible_by, tensor_parallel))
    return size if size % tensor_parallel == 0 else padded_vocab_size(size, divisible_by, tensor_parallel)


def _from_flags(args: argparse.Namespace, vocab: int, tokenizer: Any) -> transformers.PretrainedConfig:
    """The config Megatron's size flags describe (validate_args has checked that they are given and fit)."""
    L, h, a, s = args.num_layers, args.hidden_size, args.num_attention_heads, args.max_position_embeddings
    ffn = args.ffn_hidden_size or 4 * h
    hd, ad, std = args.hidden_dropout, args.attention_dropout, args.init_method_std
    eod = getattr(tokenizer, "eod", None)
    kind = args.model_type
    if kind not in CONFIGS:
        return _scaled_down(kind, args, vocab, ffn, eod)
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
) -> transformers.PretrainedConfig:
    """Any other transformers model type: its config class's defaults, with the size flags in its
    standard fields (``hidden_size``, ``num_hidden_layers``, ... or their aliases), and the optional
    ones (FFN width, key/value heads, dropout, init) where it has them. No padding id: the
    end-of-document token must keep its embedding's gradient."""
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
    optional = dict(intermediate_size=ffn, num_key_value_heads=args.num_query_groups or args.num_attention_heads,
                    attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
                    initializer_range=args.init_method_std, bos_token_id=eod, eos_token_id=eod)  # fmt: skip
    config = cls(**sizes, **{k: v for k, v in optional.items() if hasattr(default, k)})
    if getattr(config, "pad_token_id", None) is not None:  # a default's id may even lie beyond the vocabulary
        config.pad_token_id = None
    if getattr(config, "head_dim", None) and not getattr(config, "qk_rope_head_dim", None):
        # derived from the width, not the default's (multi-head latent attention's head_dim is its rotary part)
        config.head_dim = args.hidden_size // args.num_attention_heads
    _set_experts(config, default, args, ffn)
    return config


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
) -> None:
    """The MoE flags into an MoE family's config. The family's expert count is sized for its full
    model, so ``--num-experts`` is required (Megatron's models have none without it); top-k is the
    family's (at most the experts), and the experts' widths are ``--ffn-hidden-size`` scaled as the
    family scales them. A flag a family has no field for is refused rather than ignored."""
    count = _field(config, "num_experts")
    for flag in _MOE_FIELDS:
        if getattr(args, flag) is not None and _field(config, flag) is None:
            hint = " (its experts are --ffn-hidden-size wide)" if count and flag == "moe_ffn_hidden_size" else ""
            raise ConfigError(f"--{flag.replace('_', '-')}: the {config.model_type} config has no "
                              f"{' or '.join(_MOE_FIELDS[flag])} to take it{hint}")  # fmt: skip
    if count is None:
        return
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
    for flag, given in (("moe_ffn_hidden_size", args.moe_ffn_hidden_size),
                        ("moe_shared_expert_intermediate_size", args.moe_shared_expert_intermediate_size)):  # fmt: skip
        field = _field(config, flag)
        if field is not None:
            scaled = ffn * getattr(default, field) // family_ffn if family_ffn else ffn
            setattr(config, field, given or max(1, scaled))


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary's two sizes: the ids export keeps (``true_size``) and the embedding rows the
    model trains with, padded so that they shard evenly (``padded_size``)."""

    true_size: int
    padded_size: int


def vocabulary(
    args: argparse.Namespace, tokenizer: Any, hf_config: transformers.PretrainedConfig | None = None
) -> Vocabulary:
    """The run's vocabulary: the tokenizer's, padded Megatron's way; with an HF config (``--hf-config``,
    ``--load-hf``), the model's own rows where they are more (see :func:`hf_vocab_size`)."""
    tp, multiple = args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
    if hf_config is None:
        return Vocabulary(tokenizer.vocab_size, padded_vocab_size(tokenizer.vocab_size, multiple, tp))
    return Vocabulary(max(hf_config.vocab_size, tokenizer.vocab_size),  # export keeps the model's rows
                      hf_vocab_size(hf_config.vocab_size, tokenizer.vocab_size, multiple, tp))  # fmt: skip


def _check_read(args: argparse.Namespace, hf_config: transformers.PretrainedConfig | None) -> None:
    """A caller's mistake, not the user's: ``--hf-config``/``--load-hf`` given, but the config it
    names not passed in (the model would silently take the size flags' shape)."""
    if hf_config is None and (args.hf_config or args.load_hf):
        raise ValueError("pass the config read_hf_config(args) read for --hf-config / --load-hf")


def build_config(
    args: argparse.Namespace,
    tokenizer: Any,
    hf_config: transformers.PretrainedConfig | None = None,
    shared_kv_heads: bool = False,
) -> transformers.PretrainedConfig:
    """The HF config of the run (a copy of ``hf_config``, the one :func:`read_hf_config` read, else
    one from the size flags) with the padded :func:`vocabulary`, checked against the TP size
    (``shared_kv_heads``: the schedule is ``auto``, see :func:`check_divisible`)."""
    _check_read(args, hf_config)
    tp = args.tensor_model_parallel_size
    padded = vocabulary(args, tokenizer, hf_config).padded_size
    if hf_config is not None:
        config = copy.deepcopy(hf_config)
        config.vocab_size = padded
    else:
        try:
            config = _from_flags(args, padded, tokenizer)
        except StrictDataclassError as e:  # transformers' own checks of a config's fields
            raise ConfigError(f"--model-type {args.model_type}: transformers refuses a config of the size flags: "
                              f"{' '.join(str(e).split())}") from e  # fmt: skip
    check_divisible(config, tp, shared_kv_heads=shared_kv_heads)
    if args.seq_length and args.seq_length > getattr(config, "max_position_embeddings", args.seq_length):
        raise ConfigError(
            f"--seq-length {args.seq_length} exceeds the model's {config.max_position_embeddings} positions"
        )
    return config


def build_vision_config(
    args: argparse.Namespace, hf_config: transformers.PretrainedConfig | None = None
) -> transformers.PretrainedConfig:
    """The image model's config (``hf_config``, the one :func:`read_hf_config` read, else one from
    the size flags), checked against the TP size. Images under 64 pixels get the 3x3 stem without
    max-pool (CIFAR's), larger ones torchvision's ImageNet stem."""
    _check_read(args, hf_config)
    if hf_config is not None:
        config = hf_config
        if not isinstance(config, WideResNetConfig):
            raise ConfigError(f"{args.load_hf or args.hf_config} holds a {config.model_type} model: pretrain_vision.py "
                              "trains WideResNet (--model-type wideresnet)")  # fmt: skip
    else:
        config = WideResNetConfig(layers=args.resnet_layers, width_per_group=args.width_per_group,
                                  base_channels=args.base_channels, num_channels=args.num_channels,
                                  small_images=max(args.img_h, args.img_w) < 64, num_labels=args.num_classes)  # fmt: skip
    if config.num_labels != args.num_classes or config.num_channels != args.num_channels:
        raise ConfigError(f"the model classifies {config.num_labels} classes of {config.num_channels}-channel images, "
                          f"not --num-classes {args.num_classes} of --num-channels {args.num_channels}")  # fmt: skip
    check_channels(config, args.tensor_model_parallel_size)
    return config


def megatron_shape(config: transformers.PretrainedConfig, tensor_parallel: int) -> ModelShape:
    """The model's :class:`ModelShape`, as Megatron's size flags would give it: an image model's
    width is its last stage's channels, and its "heads" (it has none) the TP size, which
    megatron-core requires to divide them."""
    if isinstance(config, WideResNetConfig):
        return ModelShape(config.num_hidden_layers, config.channels[-1], tensor_parallel)
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.num_attention_heads)


def check_channels(config: WideResNetConfig, tp: int) -> None:
    """Every stage's bottleneck width and output channels must split evenly across the TP ranks."""
    for stage, (width, channels) in enumerate(zip(config.widths, config.channels, strict=True)):
        for what, size in (("bottleneck width", width), ("output channels", channels)):
            if size % tp:
                raise ConfigError(
                    f"--tensor-model-parallel-size {tp} does not divide stage {stage + 1}'s {size} {what}"
                )


def read_hf_config(args: argparse.Namespace) -> transformers.PretrainedConfig | None:
    """The config of ``--load-hf DIR`` or ``--hf-config NAME_OR_DIR``, checked to be a model this
    task trains, of the ``--model-type`` given, that can be built, and (``--load-hf``) to come with
    readable weights (:mod:`~megatron_slapo.training.pretrained`); None without either (the size
    flags shape the model)."""
    if not (args.load_hf or args.hf_config):
        return None
    flag, source = ("--load-hf", args.load_hf) if args.load_hf else ("--hf-config", args.hf_config)
    where = f"{flag} {source}"
    if args.load_hf and not os.path.isfile(os.path.join(source, "config.json")):
        what = "has no config.json" if os.path.isdir(source) else "is not a directory"
        raise ConfigError(
            f"{where} {what}: give a directory written by save_pretrained (or convert_checkpoint.py to-hf)"
        )
    if os.path.isdir(source):
        pretrained.check_config_json(where, source)
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        what = (
            "a directory nor a model name that can be fetched" if not os.path.isdir(source) else "a valid HF directory"
        )
        raise ConfigError(f"{where} is neither {what} ({type(e).__name__})") from e
    except (StrictDataclassError, ArithmeticError, TypeError) as e:  # its fields, as transformers checks them
        raise ConfigError(f"{where}: transformers refuses its config.json ({type(e).__name__}: "
                          f"{' '.join(str(e).split())}); fix the config") from e  # fmt: skip
    pretrained.check_task_fits(config, args.task, where)
    pretrained.check_shape(config, where)
    if args.model_type not in (default_model_type(args.task), config.model_type):  # the default yields to the config
        raise ConfigError(f"--model-type {args.model_type} contradicts {where}, which holds a {config.model_type} "
                          "model: drop --model-type (the config names the model)")  # fmt: skip
    if args.load_hf:
        pretrained.check_weights(where, source)
    return config


def check_divisible(config: transformers.PretrainedConfig, tp: int, shared_kv_heads: bool = False) -> None:
    """Heads, key/value heads and FFN widths (the experts' too) must split evenly across the TP ranks;
    with ``shared_kv_heads`` (``--schedule auto``) the TP size may instead be a multiple of the
    key/value heads, each then shared by several ranks, as Megatron allows."""
    sizes = {
        "attention heads": getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None),
        "key/value heads": getattr(config, "num_key_value_heads", None),
        "FFN hidden size": getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        or getattr(config, "ffn_dim", None) or getattr(config, "d_ff", None),
        "experts' FFN hidden size": getattr(config, "moe_intermediate_size", None),
        "shared experts' FFN hidden size": getattr(config, "shared_expert_intermediate_size", None),
    }  # fmt: skip
    kv = sizes["key/value heads"]
    if shared_kv_heads and kv and tp % kv == 0:
        del sizes["key/value heads"]
    for what, size in sizes.items():
        if size and size % tp:
            also = " (nor is it a multiple of them)" if shared_kv_heads and what == "key/value heads" else ""
            raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the {size} {what}{also}")


def auto_class(task: str, bert_binary_head: bool = False) -> type:
    """The HF auto class ``task`` builds: causal LM; BERT pretraining heads, or masked LM without a
    binary head; sequence-to-sequence LM (T5); image classifier."""
    if task == "vision":
        return transformers.AutoModelForImageClassification
    if task == "t5":
        return transformers.AutoModelForSeq2SeqLM
    if task == "gpt":
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForPreTraining if bert_binary_head else transformers.AutoModelForMaskedLM


# Megatron's --attention-backend in transformers' terms: its fused kernels are SDPA restricted to
# them (kernels/attention.py); "unfused"/"local" keep the probabilities as a tensor (what selective
# recompute saves most on).
ATTENTION_BACKENDS = {"auto": None, "flash": attention.implementation("flash"),
                      "fused": attention.implementation("fused"), "unfused": "eager", "local": "eager"}  # fmt: skip


def check_attention_backend(args: argparse.Namespace) -> None:
    """ConfigError, before anything is built, when the --attention-backend kernel cannot train here."""
    if getattr(args, "attention_backend", None) in attention.KERNELS:  # image models have no attention
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = half_precision(args) or torch.float32  # the attention's inputs
        problem = attention.unavailable(args.attention_backend, device, args.attention_dropout, dtype)
        if problem:
            raise ConfigError(f"--attention-backend {args.attention_backend}: {problem}; use --attention-backend "
                              "auto (torch picks a kernel) or unfused")  # fmt: skip


def create_model(args: argparse.Namespace, task: str, config: transformers.PretrainedConfig) -> nn.Module:
    """``task``'s model (:func:`auto_class`) on the meta device, or with ``--load-hf`` the pretrained
    weights (a language model's vocabulary padded)."""
    auto = auto_class(task, getattr(args, "bert_binary_head", False))
    backend = ATTENTION_BACKENDS[getattr(args, "attention_backend", "auto")]
    kwargs = {"attn_implementation": backend} if backend else {}
    try:
        if args.load_hf:
            model = auto.from_pretrained(args.load_hf, **kwargs)
            if task != "vision" and model.get_input_embeddings().num_embeddings != config.vocab_size:
                model.resize_token_embeddings(config.vocab_size, mean_resizing=False)
            return model
        with torch.device("meta"):
            return auto.from_config(config, **kwargs)
    except ValueError as e:
        if "does not support an attention implementation" not in str(e):
            raise
        raise ConfigError(f"--attention-backend {args.attention_backend}: the HF {config.model_type} model has no "
                          "SDPA attention; use --attention-backend auto or unfused") from e  # fmt: skip


def vocab_parameter_names(model: nn.Module) -> list[str]:
    """Names (ties included) of the tensors with one row per vocabulary entry: embedding, LM head, its
    bias (none for an image model)."""
    if model.main_input_name == "pixel_values":
        return []
    out = model.get_output_embeddings()
    vocab_tensors = [model.get_input_embeddings().weight, getattr(out, "weight", None), getattr(out, "bias", None)]
    ids = {id(t) for t in vocab_tensors if t is not None}
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


def tied_weights(model: nn.Module) -> dict[str, str]:
    """HF's tied weights of ``model`` as built (name -> the name it is tied to; none when the
    config unties them)."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def pipeline_stages(args: argparse.Namespace, num_layers: int) -> int:
    """How many stages the model is cut into: pipeline ranks x virtual stages per rank."""
    pp, per_virtual = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if per_virtual:
        if num_layers % (per_virtual * pp):
            raise ConfigError(f"{num_layers} layers do not split into {pp} pipeline ranks x stages of "
                              f"--num-layers-per-virtual-pipeline-stage {per_virtual}")  # fmt: skip
        return num_layers // per_virtual
    if num_layers % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} does not divide the {num_layers} layers")
    return pp


def pipeline_cuts(config: transformers.PretrainedConfig, layers: list[str], stages: int) -> list[str]:
    """Where each stage after the first starts: at layers evenly spaced, or, for an encoder-decoder
    in two stages, at its decoder stack, so that only the encoder's output crosses the cut."""
    if getattr(config, "is_encoder_decoder", False) and stages > 1:  # validate_args allows T5 two stages only
        if config.num_decoder_layers != config.num_layers:  # recompute counts the stages' layers as halves
            raise ConfigError(f"T5 in two pipeline stages needs stacks of equal depth, not {config.num_layers} "
                              f"encoder and {config.num_decoder_layers} decoder layers")  # fmt: skip
        return ["decoder"]
    return [layers[k * len(layers) // stages] for k in range(1, stages)]


def trace_for_pipeline(sch: Any, task: Any, args: argparse.Namespace, layers: list[str], seq_length: int) -> None:
    """Trace what lies between the root and the layers, for the micro-batch shape, so it can be cut.

    Only the layers' ancestors (``transformer``, ``bert.encoder``, T5's two stacks ...) become graphs; everything
    else (layers, embeddings, heads) stays the HF module it was, so the schedule's plans and HF's
    initialisation see them unchanged. The graph is specialised to ``--micro-batch-size`` x
    ``seq_length`` (the run's), which every micro-batch has; the task's non-tensor inputs (``use_cache=False``)
    become constants. The traced model returns only its logits (what the tasks' losses read): its
    other outputs (an encoder's last state, hidden states) would have to cross the stage cuts.
    """
    ancestors = {layer.rsplit(".", i)[0] for layer in layers for i in range(1, layer.count(".") + 1)} | {""}
    leaves = {type(m) for path, m in sch.mod.named_modules() if path not in ancestors
              and path.rpartition(".")[0] in ancestors}  # fmt: skip
    decoder_keys = getattr(task, "DECODER_KEYS", ())  # an encoder-decoder's decoder inputs are shorter

    class ExampleBatch(dict):
        def __missing__(self, key: str) -> torch.Tensor:
            length = args.decoder_seq_length if key in decoder_keys else seq_length
            return torch.zeros(args.micro_batch_size, length, dtype=torch.long, device="meta")

    example = task.inputs(ExampleBatch())
    sch.trace(
        example_inputs={k: v for k, v in example.items() if torch.is_tensor(v)},
        concrete_args={k: v for k, v in example.items() if not torch.is_tensor(v)},
        leaf_modules=sorted(leaves, key=lambda t: t.__name__),
    )
    _return_logits_only(sch.mod)


def _return_logits_only(graph_module: Any) -> None:
    """Keep only the ``*logits`` fields of the HF output the traced root builds; drop what only
    the other fields used."""
    built = graph_module.graph.output_node().args[0]
    if isinstance(built, torch.fx.Node) and built.op == "call_function" and isinstance(built.target, type):
        built.kwargs = {k: v for k, v in built.kwargs.items() if k.endswith("logits")}
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
