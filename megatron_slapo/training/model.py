"""The HF model a run trains: from Megatron's size flags, an HF config, or pretrained weights.

The model is created on the meta device (``build`` gives each rank only its shards) unless
``--load-hf`` starts from real pretrained weights. Its vocabulary is padded the way Megatron pads
it (:mod:`~megatron_slapo.models.vocabulary`).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from megatron_slapo.arguments.chosen import user_gave
from megatron_slapo.arguments.config_from_flags import config_from_flags
from megatron_slapo.arguments.validation import default_model_type
from megatron_slapo.arguments.widths import Derived, check_divisible
from megatron_slapo.checkpoints import checkpointing, pretrained
from megatron_slapo.engines.base import ModelShape
from megatron_slapo.engines.optimizer import half_precision
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels import attention
from megatron_slapo.models.vocabulary import vocabulary
from megatron_slapo.models.wideresnet import WideResNetConfig


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
    derived: dict[str, Derived] = {}  # an HF config's widths are its own
    if hf_config is not None:
        config = copy.deepcopy(hf_config)
        config.vocab_size = padded
    else:
        try:
            config, derived = config_from_flags(args, padded, tokenizer)
        except StrictDataclassError as e:  # transformers' own checks of a config's fields
            raise ConfigError(f"--model-type {args.model_type}: transformers refuses a config of the size flags: "
                              f"{' '.join(str(e).split())}") from e  # fmt: skip
    check_divisible(config, tp, shared_kv_heads=shared_kv_heads, derived=derived)
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
    """The config of ``--load-hf DIR`` or ``--hf-config NAME_OR_DIR`` (an HF directory or name, or a
    checkpoint directory: the model it records, as ``--load`` supplies it), checked to be a model
    this task trains, of the ``--model-type`` and size flags given, that can be built, and
    (``--load-hf``) to come with readable weights (:mod:`~megatron_slapo.checkpoints.pretrained`);
    None without either (the size flags shape the model)."""
    if not (args.load_hf or args.hf_config):
        return None
    flag, source = ("--load-hf", args.load_hf) if args.load_hf else ("--hf-config", args.hf_config)
    saved = checkpointing.read_saved_model(source) if args.hf_config and os.path.isdir(source) else None
    if saved is not None:  # a checkpoint's model, named as the user gave it
        where, config = f"{'--load' if source == args.load else flag} {source}", saved.config()
    else:
        where = f"{flag} {source}"
        config = _read_hf_directory(args, where, source)
    pretrained.check_task_fits(config, args.task, where)
    pretrained.check_shape(config, where)
    if args.model_type not in (default_model_type(args.task), config.model_type):  # the default yields to the config
        raise ConfigError(f"--model-type {args.model_type} contradicts {where}, which holds a {config.model_type} "
                          "model: drop --model-type (the config names the model)")  # fmt: skip
    _check_size_flags(args, config, where)
    if args.load_hf:
        pretrained.check_weights(where, source)
    return config


def _read_hf_directory(args: argparse.Namespace, where: str, source: str) -> transformers.PretrainedConfig:
    """The HF config of the directory or model name ``source``, each problem with it named."""
    if args.load_hf and not os.path.isfile(os.path.join(source, "config.json")):
        what = "has no config.json" if os.path.isdir(source) else "is not a directory"
        raise ConfigError(
            f"{where} {what}: give a directory written by save_pretrained (or convert_checkpoint.py to-hf)"
        )
    if os.path.isdir(source):
        pretrained.check_config_json(where, source)
    try:
        return transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        what = (
            "a directory nor a model name that can be fetched" if not os.path.isdir(source) else "a valid HF directory"
        )
        raise ConfigError(f"{where} is neither {what} ({type(e).__name__})") from e
    except (StrictDataclassError, ArithmeticError, TypeError) as e:  # its fields, as transformers checks them
        raise ConfigError(f"{where}: transformers refuses its config.json ({type(e).__name__}: "
                          f"{' '.join(str(e).split())}); fix the config") from e  # fmt: skip


# The size flags an HF config's fields give (aliases count: GPT-2's n_layer is its num_hidden_layers)
_SIZE_FIELDS = {
    "num_layers": ("num_hidden_layers",), "hidden_size": ("hidden_size",),
    "num_attention_heads": ("num_attention_heads",), "num_query_groups": ("num_key_value_heads",),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
}  # fmt: skip
# Not --max-position-embeddings: validation defaults it to --seq-length, so a value there is not
# the user's; a --seq-length beyond the config's positions is refused by build_config.


def _check_size_flags(args: argparse.Namespace, config: transformers.PretrainedConfig, where: str) -> None:
    """Refuse, in one line, the size flags given beside a config (``where``) that says otherwise: the
    config shapes the model, so each would be ignored."""
    problems = []
    for name, fields in _SIZE_FIELDS.items():
        value = getattr(args, name, None)
        held = next((getattr(config, f) for f in fields if getattr(config, f, None) is not None), None)
        if user_gave(args, name) and held is not None and held != value:
            problems.append(f"--{name.replace('_', '-')} {value} contradicts {where}, whose model has {held}")
    if problems:
        raise ConfigError(f"{'; '.join(problems)}: drop {'it' if len(problems) == 1 else 'them'} (the config shapes "
                          "the model)")  # fmt: skip


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
