"""Convert between megatron_slapo checkpoints (TP-sharded, Megatron layout) and HF model directories.

To HF (one process; reassembles the shards and drops the vocabulary padding)::

    python tools/convert_checkpoint.py to-hf --load checkpoints/gpt --save-hf hf-gpt [--iteration N]

From HF (one process per tensor-parallel rank; an iteration-0 checkpoint for ``--load``)::

    torchrun --nproc_per_node 2 tools/convert_checkpoint.py from-hf --load-hf hf-gpt \\
        --save checkpoints/gpt-tp2 --schedule gpt_tp --tensor-model-parallel-size 2
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import json
import os
import re
import sys

import safetensors
import torch
import transformers
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from megatron_slapo.errors import CheckpointError, ConfigError
from megatron_slapo.models import MODEL_CLASSES
from megatron_slapo.parallel.layout import unshard
from megatron_slapo.parallel.state import Layout
from megatron_slapo.training import checkpointing
from megatron_slapo.training.output_paths import check_output_dir

HF_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


def check_target(flag: str, path: str) -> None:
    """Refuse a target that is a file, cannot be written, or already holds a checkpoint or an HF
    model: the conversion would write over it (or, for a checkpoint, move its latest iteration)."""
    check_output_dir(flag, path)
    if os.path.exists(os.path.join(path, checkpointing.LATEST)) or checkpointing.saved_iterations(path):
        raise ConfigError(f"{flag} {path} already holds a checkpoint ({checkpointing.LATEST}, iter_*): converting "
                          "into it would replace its latest iteration; give a new directory")  # fmt: skip
    held = [name for name in ("config.json", *HF_WEIGHTS) if os.path.exists(os.path.join(path, name))]
    if held:
        raise ConfigError(f"{flag} {path} already holds an HF model ({', '.join(held)}): give a new directory")


def _hf_source(load_hf: str) -> transformers.PretrainedConfig:
    """The config of the HF directory ``load_hf``, checked to hold the model's weights too."""
    if not os.path.isfile(os.path.join(load_hf, "config.json")):
        what = "has no config.json" if os.path.isdir(load_hf) else "is not a directory"
        raise ConfigError(f"--load-hf {load_hf} {what}: give a directory written by save_pretrained or to-hf")
    if not any(os.path.isfile(os.path.join(load_hf, name)) for name in HF_WEIGHTS):
        raise ConfigError(f"--load-hf {load_hf} has a config.json but no weights ({SAFE_WEIGHTS_NAME} or "
                          f"{WEIGHTS_NAME}): give a directory written by save_pretrained or to-hf")  # fmt: skip
    try:
        return transformers.AutoConfig.from_pretrained(load_hf)
    except (OSError, ValueError) as e:  # malformed JSON, an unknown model_type
        raise ConfigError(f"--load-hf {load_hf}/config.json cannot be read: {str(e).splitlines()[0]}") from e


def read_shards(load_dir: str, iteration: int | None) -> tuple[int, list[dict]]:
    """Every TP rank's state of one iteration (the files of its pipeline stages merged)."""
    if iteration is None:
        iteration = checkpointing.latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"{load_dir} has no {checkpointing.LATEST}")
    root = checkpointing.committed_dir(load_dir, iteration)
    if not os.path.isdir(root):
        raise CheckpointError(f"{root} does not exist")
    by_tp: dict[int, list[str]] = {}
    for d in sorted(os.listdir(root)):
        match = re.fullmatch(r"mp_rank_(\d\d)(_\d\d\d)?", d)
        if match:
            by_tp.setdefault(int(match.group(1)), []).append(d)
    if not by_tp:
        raise CheckpointError(f"{root} holds no mp_rank_XX directories")
    states = [_merge_stages([checkpointing.read(os.path.join(root, d, checkpointing.FILENAME)) for d in dirs])
              for _, dirs in sorted(by_tp.items())]  # fmt: skip
    expected = states[0]["slapo"]["tensor_parallel_size"]
    if len(states) != expected:
        raise CheckpointError(f"{root} has {len(states)} TP ranks, its metadata says {expected}")
    return iteration, states


def _merge_stages(stages: list[dict]) -> dict:
    """One TP rank's pipeline-stage files as one: their weights and shard layouts together."""
    merged = dict(stages[0])
    merged["model"] = {k: v for s in stages for k, v in s["model"].items()}
    merged["slapo"] = {**stages[0]["slapo"], "shards": {k: v for s in stages for k, v in s["slapo"]["shards"].items()}}
    return merged


def full_state_dict(states: list[dict]) -> dict[str, torch.Tensor]:
    """Reassemble sharded tensors and drop the vocabulary padding rows."""
    meta = states[0]["slapo"]
    out = {}
    for name, tensor in states[0]["model"].items():
        if name in meta["shards"]:
            dim, stride = meta["shards"][name]
            tensor = unshard([s["model"][name] for s in states], dim, stride)
        if name in meta["vocab"]["params"]:
            tensor = tensor[: meta["vocab"]["true"]]
        out[name] = tensor.contiguous()
    return out


def to_hf(args: argparse.Namespace) -> None:
    check_target("--save-hf", args.save_hf)
    iteration, states = read_shards(args.load, args.iteration)
    meta = states[0]["slapo"]
    config_dict = json.loads(meta["hf_config"])
    config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    if meta["vocab"]["true"] is not None:  # image models have no vocabulary
        config.vocab_size = meta["vocab"]["true"]
    with torch.device("meta"):
        model = (getattr(transformers, meta["model_class"], None) or MODEL_CLASSES[meta["model_class"]])(config)
    model.load_state_dict(full_state_dict(states), assign=True)
    model.tie_weights()
    model.save_pretrained(args.save_hf, safe_serialization=True)
    saved_args = json.loads(states[0]["args"])
    tokenizer_note = "" if saved_args.get("task") == "vision" else _save_tokenizer(saved_args, args.save_hf)
    print(
        f"wrote {type(model).__name__} (iteration {iteration}, TP {len(states)} -> 1){tokenizer_note} to {args.save_hf}"
    )


def _save_tokenizer(saved_args: dict, save_hf: str) -> str:
    """Save the run's tokenizer beside the model; return what to add to the report."""
    try:
        from megatron_slapo.data.tokenizers import Tokenizer, build_tokenizer

        tok = build_tokenizer(saved_args["tokenizer_type"], saved_args.get("vocab_file"), saved_args.get("merge_file"),
                              saved_args.get("tokenizer_model"), saved_args.get("vocab_size"),
                              saved_args.get("vocab_extra_ids") or 0)  # fmt: skip
    except (ValueError, FileNotFoundError, TypeError, KeyError):
        return " (tokenizer files not found: copy them yourself)"
    if not isinstance(tok, Tokenizer):
        return ""
    tok.hf.save_pretrained(save_hf)
    return " and its tokenizer"


def from_hf(args: argparse.Namespace) -> None:
    import megatron_slapo as ms
    from megatron_slapo import parallel
    from megatron_slapo.training.arguments import BERT_MODEL_TYPES, T5_MODEL_TYPES, VISION_MODEL_TYPES
    from megatron_slapo.training.model import (
        Vocabulary,
        auto_class,
        check_channels,
        check_divisible,
        hf_vocab_size,
        vocab_parameter_names,
    )
    from schedules import check_fits, get_schedule

    tp, world = args.tensor_model_parallel_size, int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or world % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} needs a multiple of {tp} processes, one per rank, and this "
                          f"is {world}: run it as torchrun --nproc_per_node {max(tp, 1)} tools/convert_checkpoint.py "
                          "from-hf ...")  # fmt: skip
    config = _hf_source(args.load_hf)
    check_target("--save", args.save)
    get_schedule(args.schedule)  # an unknown name is refused before the process groups start
    check_fits(args.schedule, config.model_type)
    parallel.initialize(tensor_parallel=tp)
    families = {**dict.fromkeys(VISION_MODEL_TYPES, "vision"), **dict.fromkeys(BERT_MODEL_TYPES, "bert"),
                **dict.fromkeys(T5_MODEL_TYPES, "t5")}  # fmt: skip
    task = families.get(config.model_type, "gpt")
    binary_head = not args.bert_no_binary_head and config.model_type != "roberta"  # as pretrain_bert.py decides
    try:
        model = auto_class(task, binary_head).from_pretrained(args.load_hf)
    except (OSError, ValueError, safetensors.SafetensorError) as e:  # truncated or mismatched weights
        raise ConfigError(f"--load-hf {args.load_hf}: cannot load its weights: {str(e).splitlines()[0][:300]}") from e
    true_vocab = padded = None  # an image model has no vocabulary
    if task == "vision":
        check_channels(model.config, tp)
    else:
        true_vocab = model.get_input_embeddings().num_embeddings
        # The rows a training run with --load-hf gives this model (its tokenizer taken to be the model's).
        padded = hf_vocab_size(true_vocab, true_vocab, args.make_vocab_size_divisible_by, tp)
        if padded != true_vocab:
            model.resize_token_embeddings(padded, mean_resizing=False)
        check_divisible(model.config, tp, shared_kv_heads=args.schedule == "auto")
    vocab_params = vocab_parameter_names(model)
    sch = ms.create_schedule(model)
    get_schedule(args.schedule).apply(sch, model.config, args)
    ms.build(sch)
    run_args = argparse.Namespace(
        task=task, save=args.save, no_save_optim=True, tensor_model_parallel_size=tp,
        true_vocab_size=true_vocab, padded_vocab_size=padded, schedule=args.schedule, load_hf=args.load_hf,
        num_layers=model.config.num_hidden_layers,  # what a run loading it must build (checkpointing.load)
    )  # fmt: skip
    os.makedirs(args.save, exist_ok=True)
    engine = _WeightsOnly(model)
    vocab = Vocabulary(true_vocab, padded) if true_vocab is not None else None
    metadata = checkpointing.export_metadata(
        model.state_dict(keep_vars=True), type(model).__name__, task, model.config, vocab, vocab_params, tp
    )
    layout, resume = Layout.current(), checkpointing.Resume()
    path = checkpointing.save(engine, run_args, layout, resume, metadata, vars(run_args))
    if torch.distributed.get_rank() == 0:
        print(f"wrote {path} (TP {tp}); train from it with --load {args.save} --finetune (or --no-load-optim)")


class _WeightsOnly:
    """The part of the engine interface that saving a weights-only checkpoint needs."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict:
        return {"model": self.model.state_dict()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-hf", help="checkpoint -> HF directory (safetensors)")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, help="default: the latest")
    a.add_argument("--save-hf", required=True)
    b = sub.add_parser("from-hf", help="HF directory -> checkpoint (run under torchrun with TP processes)")
    b.add_argument("--load-hf", required=True)
    b.add_argument("--save", required=True)
    b.add_argument("--schedule", required=True)
    b.add_argument("--tensor-model-parallel-size", type=int, default=1)
    b.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    b.add_argument("--bert-no-binary-head", action="store_true", help="BERT: the masked-LM model only (no SOP head)")
    args = p.parse_args(argv)
    try:
        to_hf(args) if args.direction == "to-hf" else from_hf(args)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        sys.exit(f"convert_checkpoint.py: error: {e}")


if __name__ == "__main__":
    main()
