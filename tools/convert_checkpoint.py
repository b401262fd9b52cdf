"""Convert checkpoints to and from HF model directories, and between the two checkpoint formats.

Both of Megatron-LM's formats are read and written: ``torch_dist`` (the trainer's default: every
tensor once, whole, loadable at any layout and on any engine) and ``torch`` (the legacy
``iter_N/mp_rank_XX/model_optim_rng.pt`` files, one per tensor-parallel rank).

To HF (one process, no torchrun, either format; TP shards merged, the vocabulary padding dropped)::

    python tools/convert_checkpoint.py to-hf --load checkpoints/gpt --save-hf hf-gpt [--iteration N]

From HF, an iteration-0 checkpoint to train from (``--load DIR --use-checkpoint-args --finetune``: the
checkpoint gives the model's flags; the trainer's command is printed, as by every direction that
writes a checkpoint): ``torch_dist`` in one
process (it loads at any layout), or ``torch`` at one tensor-parallel size, one process per rank::

    python tools/convert_checkpoint.py from-hf --load-hf hf-gpt --save checkpoints/gpt
    torchrun --nproc_per_node 2 tools/convert_checkpoint.py from-hf --load-hf hf-gpt --ckpt-format torch \\
        --save checkpoints/gpt-tp2 --schedule gpt_tp --tensor-model-parallel-size 2

Between the formats (the weights, the iteration, the consumed samples, the recorded arguments)::

    python tools/convert_checkpoint.py to-torch-dist --load checkpoints/legacy --save checkpoints/dist
    torchrun --nproc_per_node 2 tools/convert_checkpoint.py to-torch --load checkpoints/dist \\
        --save checkpoints/legacy-tp2 --schedule gpt_tp --tensor-model-parallel-size 2

The optimizer and RNG states are not converted: resume from a converted checkpoint with
``--no-load-optim --no-load-rng``. To keep the optimizer state, resume the ``torch`` checkpoint at
the layout that saved it with ``--auto-detect-ckpt-format``: that run then saves ``torch_dist``.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from megatron_slapo.arguments.output_paths import check_output_dir
from megatron_slapo.checkpoints import checkpoint_integrity, checkpointing, conversion, dist_checkpoint
from megatron_slapo.checkpoints.checkpoint_files import Resume
from megatron_slapo.errors import CheckpointError, ConfigError
from megatron_slapo.models.vocabulary import Vocabulary, hf_vocab_size, tied_weights, vocab_parameter_names
from megatron_slapo.parallel.agreement import agreed_errors
from megatron_slapo.parallel.state import Layout
from megatron_slapo.training.model import auto_class, check_channels, check_divisible

ROOT = Path(__file__).resolve().parents[1]
HF_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
FINETUNE_LR = "1e-5"  # the learning rate of the fine-tuning command printed after from-hf


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


def to_hf(args: argparse.Namespace) -> None:
    """A checkpoint of either format as an HF directory, with the run's tokenizer (one process)."""
    check_target("--save-hf", args.save_hf)
    source = conversion.read(args.load, args.iteration)
    model = conversion.hf_model(source)
    there = set(os.listdir(args.save_hf)) if os.path.isdir(args.save_hf) else set()
    model.save_pretrained(args.save_hf, safe_serialization=True)
    saved_args = source.recorded_args()
    tokenizer_note = "" if saved_args.get("task") == "vision" else _save_tokenizer(saved_args, args.save_hf)
    _with_default_mode(args.save_hf, there)
    how = "torch_dist" if source.format == "torch_dist" else f"TP {source.metadata['tensor_parallel_size']} -> 1"
    print(f"wrote {type(model).__name__} (iteration {source.iteration}, {how}){tokenizer_note} to {args.save_hf}")


def _with_default_mode(directory: str, there: set[str]) -> None:
    """Give the files written into ``directory`` (all but ``there``) the mode a file written plainly
    gets, 0666 less the umask: safetensors writes the weights 0600 (through a temporary file),
    beside a config and tokenizer files that others may read."""
    umask = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(umask)
    for name in sorted(set(os.listdir(directory)) - there):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            os.chmod(path, 0o666 & ~umask)


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


def _check_launch(tp: int, direction: str) -> None:
    """A ``torch`` checkpoint of tensor-parallel size ``tp`` is written by ``tp`` processes (or a multiple)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or world % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} needs a multiple of {tp} processes, one per rank, and this "
                          f"is {world}: run it as torchrun --nproc_per_node {max(tp, 1)} tools/convert_checkpoint.py "
                          f"{direction} ...")  # fmt: skip


def _check_schedule(schedule: str | None, config: transformers.PretrainedConfig, task: str, tp: int) -> None:
    """The schedule that shards a ``torch`` checkpoint: given, known, and fitting the model at
    ``tp`` (checked before the process groups start)."""
    from schedules import check_fits, get_schedule

    if schedule is None:
        raise ConfigError("--ckpt-format torch needs --schedule NAME, the tensor-parallel schedule of the runs that "
                          "will load it (pretrain_gpt.py --schedule list)")  # fmt: skip
    get_schedule(schedule)
    check_fits(schedule, config.model_type)
    if task == "vision":
        check_channels(config, tp)
    else:
        check_divisible(config, tp, shared_kv_heads=schedule == "auto")


def _shard(model: nn.Module, args: argparse.Namespace) -> None:
    """Apply ``--schedule`` to ``model`` and materialise this rank's shards (meta tensors initialised)."""
    import megatron_slapo as ms
    from schedules import get_schedule

    sch = ms.create_schedule(model)
    get_schedule(args.schedule).apply(sch, model.config, args)
    ms.build(sch)


def _metadata(model: nn.Module, task: str, vocab: tuple[int, int] | None, vocab_params: list[str]) -> dict[str, Any]:
    """What a checkpoint of ``model`` (as this rank holds it) records for export and for loading
    (:func:`~megatron_slapo.checkpoints.checkpointing.export_metadata`); ``vocab``: the true and the
    padded vocabulary sizes (None for an image model); ``vocab_params``: its vocabulary tensors."""
    return checkpointing.export_metadata(
        model.state_dict(keep_vars=True), type(model).__name__, task, model.config,
        Vocabulary(*vocab) if vocab else None, vocab_params, Layout.current().tp_size, tied_weights(model),
    )  # fmt: skip


def _save(model: nn.Module, metadata: dict[str, Any], ckpt_format: str, save: str, resume: Resume,
          recorded: dict[str, Any]) -> str:  # fmt: skip
    """Write ``model``'s weights as iteration ``resume.iteration`` of a checkpoint in ``ckpt_format``,
    as a training run saves it (``recorded``: the arguments it records). Collective; returns the
    iteration's directory. No RNG state: the converter's own would mean nothing to a run."""
    layout = Layout.current()
    run_args = argparse.Namespace(save=save, ckpt_format=ckpt_format, no_save_optim=True, no_save_rng=True,
                                  ckpt_fully_parallel_save=True, tensor_model_parallel_size=layout.tp_size)  # fmt: skip
    if dist.get_rank() == 0:
        os.makedirs(save, exist_ok=True)
    return checkpointing.save(conversion.WeightsOnly(model), run_args, layout, resume, metadata, recorded)


def _trainer_command(task: str, save: str, tp: int, schedule: str | None, flags: list[str]) -> str:
    """The trainer's command that goes on from the checkpoint ``save`` just written (``flags``: how),
    to run as printed from the repository root: the model's flags come from the checkpoint
    (``--use-checkpoint-args``); a ``torch`` checkpoint (``schedule`` given) at its own layout."""
    layout = ["--ckpt-format", "torch", "--tensor-model-parallel-size", str(tp), "--schedule", schedule]
    venv_bin = ROOT / ".venv" / "bin"  # torchrun as tools/autotune.py prints it: the venv's, else this Python's
    in_venv = Path(sys.executable).parent.resolve() == venv_bin.resolve() and (venv_bin / "torchrun").exists()
    launcher = [".venv/bin/torchrun"] if in_venv else [sys.executable, "-m", "torch.distributed.run"]
    return shlex.join([*launcher, "--standalone", f"--nproc_per_node={tp if schedule else 1}", f"pretrain_{task}.py",
                       "--load", save, "--use-checkpoint-args", *flags, *(layout if schedule else [])])  # fmt: skip


def _report(path: str, what: str, resume: Resume, command: str, task: str) -> None:
    """Rank 0: what was written, and ``command``, which trains or resumes from it as printed (a
    language model on the embedded corpus, an image model on the generated images)."""
    if dist.get_rank() != 0:
        return
    if resume.iteration == 0:
        print(f"wrote {path} ({what}); train from it: {command}")
    else:
        print(f"wrote {path} ({what}, iteration {resume.iteration}); only the weights are converted (the optimizer "
              f"and RNG states start afresh): resume with {command}")  # fmt: skip
    if task != "vision":
        print("  (as printed, the run trains on the embedded corpus; on your data add --data-path, its tokenizer flags "
              "and the training flags the embedded run chooses for you: --micro-batch-size, --train-iters, --lr, ... "
              "as its start-up line lists them)")  # fmt: skip


def _goes_on(resume: Resume) -> list[str]:
    """How a run goes on from a converted checkpoint at ``resume``: fine-tuning from iteration 0
    (from a fine-tuning learning rate), or resuming without the states a conversion drops."""
    return ["--finetune", "--lr", FINETUNE_LR] if resume.iteration == 0 else ["--no-load-optim", "--no-load-rng"]


def from_hf(args: argparse.Namespace) -> None:
    """An HF directory as an iteration-0 checkpoint: ``torch_dist`` (the HF tensors as they are) or
    ``torch`` (sharded by ``--schedule`` at ``--tensor-model-parallel-size``, its vocabulary padded)."""
    from megatron_slapo import parallel
    from megatron_slapo.arguments.parser import BERT_MODEL_TYPES, T5_MODEL_TYPES, VISION_MODEL_TYPES

    torch_format, tp = args.ckpt_format == "torch", args.tensor_model_parallel_size
    if torch_format:
        _check_launch(tp, "from-hf")
    config = _hf_source(args.load_hf)
    check_target("--save", args.save)
    families = {**dict.fromkeys(VISION_MODEL_TYPES, "vision"), **dict.fromkeys(BERT_MODEL_TYPES, "bert"),
                **dict.fromkeys(T5_MODEL_TYPES, "t5")}  # fmt: skip
    task = families.get(config.model_type, "gpt")
    if torch_format:
        _check_schedule(args.schedule, config, task, tp)
    elif tp != 1 or args.schedule:
        print("note: --schedule and --tensor-model-parallel-size shape only a --ckpt-format torch checkpoint; a "
              "torch_dist one holds the whole tensors and loads at any layout", flush=True)  # fmt: skip
    parallel.initialize(tensor_parallel=tp if torch_format else 1)
    binary_head = not args.bert_no_binary_head and config.model_type != "roberta"  # as pretrain_bert.py decides
    try:
        model = auto_class(task, binary_head).from_pretrained(args.load_hf)
    except (OSError, ValueError, safetensors.SafetensorError) as e:  # truncated or mismatched weights
        raise ConfigError(f"--load-hf {args.load_hf}: cannot load its weights: {str(e).splitlines()[0][:300]}") from e
    vocab = None  # an image model has no vocabulary
    if task != "vision":
        true_vocab = padded = model.get_input_embeddings().num_embeddings
        if torch_format:  # the rows a training run with --load-hf gives it (its tokenizer taken to be the model's)
            padded = hf_vocab_size(true_vocab, true_vocab, args.make_vocab_size_divisible_by, tp)
        if padded != true_vocab:
            model.resize_token_embeddings(padded, mean_resizing=False)
        vocab = (true_vocab, padded)
    vocab_params = vocab_parameter_names(model)
    if torch_format:
        _shard(model, args)
    recorded = {
        "task": task, "tensor_model_parallel_size": tp if torch_format else 1, "schedule": args.schedule,
        "true_vocab_size": vocab and vocab[0], "padded_vocab_size": vocab and vocab[1], "load_hf": args.load_hf,
        "num_layers": model.config.num_hidden_layers,  # what a run loading it must build (checked on load)
    }  # fmt: skip
    path = _save(model, _metadata(model, task, vocab, vocab_params), args.ckpt_format, args.save, Resume(), recorded)
    command = _trainer_command(task, args.save, tp, args.schedule if torch_format else None,
                               [*_goes_on(Resume()), *_inputs(task, model.config, args)])  # fmt: skip
    _report(path, f"TP {tp}" if torch_format else "torch_dist: loads at any layout", Resume(), command, task)


def _inputs(task: str, config: transformers.PretrainedConfig, args: argparse.Namespace) -> list[str]:
    """The flags a run of ``task`` needs beside the model's own config: a T5 model has no positions
    to take the sequence length from, an image model's classes and channels are flags that default
    to 10 and 3; BERT without its sentence-order head."""
    from megatron_slapo.arguments.parser import T5_EMBEDDED_DEFAULTS

    if task == "t5":
        return ["--seq-length", str(T5_EMBEDDED_DEFAULTS["seq_length"])]
    if task == "vision":
        return ["--num-classes", str(config.num_labels), "--num-channels", str(config.num_channels)]
    return ["--bert-no-binary-head"] if task == "bert" and args.bert_no_binary_head else []


def to_torch_dist(args: argparse.Namespace) -> None:
    """A ``torch`` checkpoint's weights as a ``torch_dist`` one (one process)."""
    from megatron_slapo import parallel

    check_target("--save", args.save)
    source = conversion.read(args.load, args.iteration)
    if source.format == "torch_dist":
        raise ConfigError(f"--load {args.load}: {source.root} is in the torch_dist format already (to-torch turns it "
                          "into a torch one)")  # fmt: skip
    model = conversion.hf_model(source, padded=True)  # the padding rows train: they are kept
    meta = source.metadata
    vocab = (meta["vocab"]["true"], meta["vocab"]["padded"]) if meta["vocab"]["true"] is not None else None
    parallel.initialize(tensor_parallel=1)
    resume = source.resume()
    metadata = _metadata(model, meta["task"], vocab, vocab_parameter_names(model))
    path = _save(model, metadata, "torch_dist", args.save, resume, source.recorded_args())
    command = _trainer_command(meta["task"], args.save, 1, None, _goes_on(resume))
    _report(path, f"torch_dist, from TP {meta['tensor_parallel_size']}", resume, command, meta["task"])
    if resume.iteration and dist.get_rank() == 0:
        print(f"  to keep the optimizer state instead, resume {args.load} at the layout that saved it with "
              "--auto-detect-ckpt-format: that run saves torch_dist")  # fmt: skip


def to_torch(args: argparse.Namespace) -> None:
    """A ``torch_dist`` checkpoint's weights as a ``torch`` one at ``--tensor-model-parallel-size``,
    one process per rank, each reading only its shards (as a training run resumes)."""
    from megatron_slapo import parallel

    tp = args.tensor_model_parallel_size
    _check_launch(tp, "to-torch")
    check_target("--save", args.save)
    source = conversion.read(args.load, args.iteration, with_weights=False)
    if source.format == "torch":
        raise ConfigError(f"--load {args.load}: {source.root} is in the torch format already (to-torch-dist turns it "
                          "into a torch_dist one, which to-torch writes at any tensor-parallel size)")  # fmt: skip
    meta, saved_args = source.metadata, source.recorded_args()
    true_vocab, vocab = meta["vocab"]["true"], None
    if true_vocab is not None:  # padded as a run at this TP size pads it
        divisible = args.make_vocab_size_divisible_by or saved_args.get("make_vocab_size_divisible_by") or 128
        vocab = (true_vocab, hf_vocab_size(true_vocab, true_vocab, divisible, tp))
    config = conversion.hf_config(meta, vocab and vocab[1])
    _check_schedule(args.schedule, config, meta["task"], tp)
    parallel.initialize(tensor_parallel=tp)
    with agreed_errors(CheckpointError):  # the ranks verify a share of the files each
        checkpoint_integrity.verify_share(source.root, skip={dist_checkpoint.COMMON})
    with torch.device("meta"):
        model = conversion.model_class(meta)(config)
    vocab_params = vocab_parameter_names(model)
    _shard(model, args)  # initialised as a run's: vocabulary rows past the checkpoint's padding keep these values
    metadata = _metadata(model, meta["task"], vocab, vocab_params)
    dist_checkpoint.load(conversion.WeightsOnly(model), source.root, source.common, Layout.current(), metadata, False)
    resume = source.resume()
    path = _save(model, metadata, "torch", args.save, resume, saved_args)
    command = _trainer_command(meta["task"], args.save, tp, args.schedule, _goes_on(resume))
    _report(path, f"TP {tp}, from torch_dist", resume, command, meta["task"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("to-hf", help="checkpoint (either format) -> HF directory (safetensors); one process")
    a.add_argument("--load", required=True)
    a.add_argument("--iteration", type=int, help="default: the latest")
    a.add_argument("--save-hf", required=True)
    b = sub.add_parser("from-hf", help="HF directory -> iteration-0 checkpoint (torch: under torchrun, TP processes)")
    b.add_argument("--load-hf", required=True)
    b.add_argument("--save", required=True)
    b.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="torch_dist (default, as the trainer's): one process, loads at any layout; torch: Megatron's "
                        "legacy files at --tensor-model-parallel-size")  # fmt: skip
    b.add_argument("--schedule", help="--ckpt-format torch: the schedule that shards it (as the runs loading it)")
    b.add_argument("--tensor-model-parallel-size", type=int, default=1, help="--ckpt-format torch only")
    b.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="--ckpt-format torch only")
    b.add_argument("--bert-no-binary-head", action="store_true", help="BERT: the masked-LM model only (no SOP head)")
    c = sub.add_parser("to-torch-dist", help="torch checkpoint -> torch_dist (weights; one process)")
    c.add_argument("--load", required=True)
    c.add_argument("--iteration", type=int, help="default: the latest")
    c.add_argument("--save", required=True)
    d = sub.add_parser("to-torch", help="torch_dist checkpoint -> torch at a TP size (weights; under torchrun, TP "
                                        "processes)")  # fmt: skip
    d.add_argument("--load", required=True)
    d.add_argument("--iteration", type=int, help="default: the latest")
    d.add_argument("--save", required=True)
    d.add_argument("--schedule", required=True, help="the schedule that shards it (as the runs loading it)")
    d.add_argument("--tensor-model-parallel-size", type=int, default=1)
    d.add_argument("--make-vocab-size-divisible-by", type=int, help="default: the saving run's (else 128)")
    args = p.parse_args(argv)
    convert = {"to-hf": to_hf, "from-hf": from_hf, "to-torch-dist": to_torch_dist, "to-torch": to_torch}
    try:
        convert[args.direction](args)
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        sys.exit(f"convert_checkpoint.py: error: {e}")


if __name__ == "__main__":
    main()
