"""What a training run will do on each rank, printed without training.

    .venv/bin/python tools/explain.py --world-size 16 --schedule gpt_tp --tensor-model-parallel-size 8 \\
        --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 1024 ...
    .venv/bin/python tools/explain.py --task bert --world-size 2 --schedule bert_tp --tensor-model-parallel-size 2

Every flag but the three below is ``pretrain_<task>.py``'s, checked as the trainer checks it. One
process plans each pipeline stage's first rank over a fake process group of ``--world-size`` ranks
(no GPU, no cluster, no weights: see :mod:`megatron_slapo.estimates.estimate`), and prints what the
schedule did to each module, then per rank: weight, gradient and optimizer bytes, activation bytes
per micro-batch (and how many micro-batches 1F1B holds at once), collective bytes per step by type
and group, the pipeline bubble and FLOPs per step; with ``--expert-model-parallel-size``, each
rank's routed experts (its bytes of them, the expert-data-parallel group) and the tokens'
all-to-all; with ``--context-parallel-size C``, each rank's figures for its ``1/C`` of every
sequence and the attention's key/value exchange between the C ranks (the ``[cp]`` rows, the
bytes ``--log-comm`` counts: :mod:`megatron_slapo.estimates.context_estimate`). With ``--load
DIR``, what the checkpoint there is and how this layout loads it (a ``torch_dist`` one: the layout
that saved it, and whether the run reshards it); the model is the checkpoint's where the size flags
are not given, and one they contradict is refused as the trainer refuses it.

- ``--task gpt|bert|t5|vision``: which trainer's flags (default gpt).
- ``--world-size N``: the ranks of the run (default: ``WORLD_SIZE``, else TP x PP), at most
  :data:`MAX_WORLD_SIZE`.
- ``--json PATH``: the estimates as JSON too (what ``tools/autotune.py`` reads); checked writable
  before planning.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from megatron_slapo.arguments.output_paths import check_output_file  # noqa: E402
from megatron_slapo.arguments.parser import OneLineParser, parse_args  # noqa: E402
from megatron_slapo.arguments.validation import validate_args  # noqa: E402
from megatron_slapo.checkpoints import checkpointing  # noqa: E402
from megatron_slapo.errors import ConfigError  # noqa: E402
from megatron_slapo.estimates.estimate import RankEstimate, estimate  # noqa: E402
from megatron_slapo.training import error_report  # noqa: E402
from megatron_slapo.training.plan import take_checkpoint_args  # noqa: E402

# megatron-core lays out the process groups of every rank, even over the fake backend: a plan takes
# about a second more per thousand ranks, so from LARGE_WORLD_SIZE on explain says it is at work, and
# beyond MAX_WORLD_SIZE (minutes) it refuses.
LARGE_WORLD_SIZE, MAX_WORLD_SIZE = 4096, 65536


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def stage_ranks(argv: list[str], task: str, world: int) -> list[int]:
    """The first rank of each pipeline stage (megatron-core's order: tensor, data, then pipeline),
    once the flags are checked as the trainer checks them (before any planning)."""
    args = parse_args(task, argv, prog="explain.py")
    take_checkpoint_args(args)  # as the run takes them: the model of --load's checkpoint, unless given
    validate_args(args, world)
    pp = args.pipeline_model_parallel_size
    return [p * (world // pp) for p in range(pp)]


def explain(task: str, argv: list[str], world: int) -> list[RankEstimate]:
    """The estimates of each pipeline stage's first rank (its tensor- and data-parallel peers hold alike)."""
    return [estimate(task, argv, world, rank) for rank in stage_ranks(argv, task, world)]


def _experts(e: RankEstimate) -> list[str]:
    """Expert parallelism's lines for rank ``e``: its share of the routed experts, their groups and
    the tokens' all-to-all (listed with the collectives above)."""
    x = e.experts
    moved = e.comm.get("all_to_all[ep]")
    return [f"Routed experts, rank {e.rank}: split across {x.expert_parallel} expert-parallel ranks (whole experts), "
            f"each by its features across {x.expert_tensor_parallel}; gradients reduced over an expert-data-parallel "
            f"group of {x.expert_data_parallel}",
            f"  weights here {x.params:>14,} B  {_mib(x.params)}, 1/{x.model_params // max(x.params, 1)} of the "
            f"model's {_mib(x.model_params)}",
            *([f"  all_to_all[ep] {moved:>12,} B  {_mib(moved)} per step: tokens x top-k x hidden x bytes, out and back, "
               "forward and backward"] if moved else [])]  # fmt: skip


def _context(e: RankEstimate) -> str:
    """Context parallelism's line for rank ``e``: what its figures cover, and what the ``[cp]`` rows are."""
    return (f"Context parallelism, rank {e.rank}: each sequence split across {e.context_parallel} ranks, this one "
            f"running 1/{e.context_parallel} of its tokens through every layer (the figures above); [cp]: the "
            "attention's keys and values exchanged between them (and their gradients, backward), the loss's sums")  # fmt: skip


def report(estimates: list[RankEstimate], world: int) -> str:
    first = estimates[0]
    lines = [f"What the schedule did (rank {first.rank}):", first.schedule, "",
             f"Per rank, of {world} (each pipeline stage's first; its tensor- and data-parallel peers hold the same):"]  # fmt: skip
    place = "(tp,pp,dp,cp)" if first.context_parallel > 1 else "(tp,pp,dp)"  # a context rank apart from the data one
    header = ("rank", place, "stages", "weights", "gradients", "optimizer", "gathered",
              "activations/micro-batch", "held", "peak", "GFLOP/step")  # fmt: skip
    rows = [header]
    for e in estimates:
        rows.append((str(e.rank), str(e.coordinates).replace(" ", ""), ",".join(map(str, e.stages)),
                     _mib(e.memory["params"]), _mib(e.memory["grads"]), _mib(e.memory["optimizer"]),
                     _mib(e.memory.get("gathered", 0)), _mib(e.activations), f"{e.in_flight:g}", _mib(e.peak), f"{e.flops / 1e9:,.2f}"))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for e in estimates:
        lines.append(f"Collectives per step, rank {e.rank} ({e.micro_batches} micro-batches):")
        lines += [f"  {key:<28} {value:>14,} B  {_mib(value)}" for key, value in e.comm.items()] or ["  none"]
        if e.experts:
            lines += _experts(e)
        if e.context_parallel > 1:
            lines.append(_context(e))
    if len(estimates) > 1 or first.bubble:
        lines.append(f"Pipeline bubble: {first.bubble:.1%} of each step idle ({len(estimates)} pipeline ranks, "
                     f"{len(first.stages)} stage(s) each, {first.micro_batches} micro-batches)")  # fmt: skip
    return "\n".join(lines)


# What --fp8-format changes in the figures above: only where the products compute
FP8_MEMORY = ("FP8: the layers marked fp8 multiply in FP8, cast from their bf16 input and weight at each use; the "
              "backward keeps those bf16 tensors, not FP8 copies, so the weights, gradients, optimizer state and "
              "activations above are the bf16 run's (the amaxes agreed across split layers add a few bytes per layer, "
              "not counted)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="explain.py", add_help=False)
    parser.add_argument("--task", choices=("gpt", "bert", "t5", "vision"), default="gpt")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--json")
    parser.add_argument("-h", "--help", action="store_true")
    with error_report.user_errors("explain.py"):
        ours, rest = parser.parse_known_args(argv)
    if ours.help:
        print(__doc__)
        return
    with error_report.user_errors("explain.py"):
        if ours.json:
            check_output_file("--json", ours.json)
        args = parse_args(ours.task, rest, prog="explain.py")
        if ours.world_size is not None:
            world = ours.world_size
        elif "WORLD_SIZE" in os.environ:
            world = int(os.environ["WORLD_SIZE"])
        else:
            world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise ConfigError(f"--world-size {world} must lie between 1 and {MAX_WORLD_SIZE}: beyond it, laying out "
                              "every rank's process groups would take minutes")  # fmt: skip
        ranks = stage_ranks(rest, ours.task, world)
        if world >= LARGE_WORLD_SIZE:
            print(f"> laying out the process groups of {world} ranks (megatron-core makes every rank's): this takes "
                  "a while", flush=True)  # fmt: skip
        estimates = [estimate(ours.task, rest, world, rank) for rank in ranks]
        loading = checkpointing.describe_load(args.load, args, world) if args.load else None
    print(report(estimates, world))
    if args.fp8_format:
        print(FP8_MEMORY)
    if loading:
        print(f"Checkpoint to load: {loading}")
    if ours.json:
        rows = [{k: v for k, v in dataclasses.asdict(e).items() if k != "schedule"} | {"peak": e.peak}
                for e in estimates]  # fmt: skip
        os.makedirs(os.path.dirname(ours.json) or ".", exist_ok=True)
        Path(ours.json).write_text(json.dumps({"world_size": world, "ranks": rows}, indent=1))


if __name__ == "__main__":
    main()
