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
- ``--hardware NAME|PATH.json``: also predict the step's time on that hardware
  (:mod:`megatron_slapo.estimates.time_model`): a built-in profile (``a100-sxm-80g``, ``h100-sxm``,
  ``h200-sxm``, ``b200``) or one ``tools/calibrate.py`` wrote. The activations are then those of the
  attention kernel it runs (flash: no score matrices). Prints the step time, tokens/s and TFLOP/s
  per device, MFU, where the time goes, and ``predicted`` in ``--json``; a layout whose peak exceeds
  the device's memory is refused in one line naming the rank and the bytes.
- ``--gpus-per-node N`` (default 8; a calibrated CPU profile: the whole run on this machine) and
  ``--nodes N`` (the world size is then nodes x gpus-per-node): which groups cross nodes.
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
from megatron_slapo.estimates import hardware  # noqa: E402
from megatron_slapo.estimates.estimate import RankEstimate, estimate  # noqa: E402
from megatron_slapo.estimates.hardware import Hardware  # noqa: E402
from megatron_slapo.estimates.layer_extrapolation import shallow_explain  # noqa: E402
from megatron_slapo.estimates.time_model import Prediction, predict  # noqa: E402
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


def explain(task: str, argv: list[str], world: int, attention: str | None = None) -> list[RankEstimate]:
    """The estimates of each pipeline stage's first rank (its tensor- and data-parallel peers hold alike);
    ``attention``: as :func:`~megatron_slapo.estimates.estimate.estimate` takes it."""
    return [estimate(task, argv, world, rank, attention=attention) for rank in stage_ranks(argv, task, world)]


def predicted(
    task: str, argv: list[str], world: int, per_node: int, hw: Hardware, shallow: bool = False
) -> tuple[list[RankEstimate], Prediction]:
    """The estimates of :func:`explain`, with the attention kernel ``hw``'s device runs, and the
    time model's step on ``hw`` (``per_node`` ranks to a node). ``shallow``: from the run planned at
    one and two layers a stage where that is exact (:mod:`~megatron_slapo.estimates.layer_extrapolation`:
    the figures, not the schedule's text, which is the shallow run's), as the tuner ranks layouts."""

    def plan(run: list[str]) -> list[RankEstimate]:
        return explain(task, run, world, attention=hw.attention_kernel)

    estimates = (shallow and shallow_explain(argv, plan)) or plan(argv)
    return estimates, predict(estimates, parse_args(task, argv), hw, world, per_node)


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


def machine_size(gpus_per_node: int | None, nodes: int | None, world: int | None, hw: Hardware | None) -> int | None:
    """Ranks to a node: ``--gpus-per-node``, else 8 on a GPU profile; on a calibrated CPU one, None
    (the whole run on one machine). Checks the flags agree."""
    if (gpus_per_node or nodes) and hw is None:
        raise ConfigError("--gpus-per-node and --nodes place a run on hardware: give --hardware too")
    if gpus_per_node is not None and gpus_per_node < 1 or nodes is not None and nodes < 1:
        raise ConfigError("--gpus-per-node and --nodes must be at least 1")
    per_node = gpus_per_node or (hardware.GPUS_PER_NODE if hw and hw.compute_units is None else None)
    if nodes is not None and per_node is None:
        raise ConfigError("--nodes needs --gpus-per-node with a CPU profile")
    if nodes is not None and world is not None and nodes * per_node != world:
        raise ConfigError(f"--world-size {world} is not --nodes {nodes} x --gpus-per-node {per_node}")
    return per_node


def prediction_report(p: Prediction, world: int, per_node: int) -> str:
    """The predicted step: its time, throughput and breakdown, and the verdict."""
    where = f"{max(1, world // per_node)} node(s) x {min(world, per_node)}"
    parts = "  ".join(f"{k} {v:.4g} s" for k, v in sorted(p.breakdown_s.items(), key=lambda kv: -kv[1]))
    return "\n".join([
        f"Predicted on {p.hardware} ({where}), slowest rank {p.slowest_rank}: step {p.step_time_s:.4g} s, "
        f"{p.tokens_per_s_per_device:,.0f} tokens/s per device, {p.tflops_per_device:,.1f} TFLOP/s per device, "
        f"MFU {p.mfu:.1%}",
        f"  {parts}",
        f"  where the time goes: {p.verdict}"])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="explain.py", add_help=False)
    parser.add_argument("--task", choices=("gpt", "bert", "t5", "vision"), default="gpt")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--json")
    parser.add_argument("--hardware")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--nodes", type=int)
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
        hw = hardware.load(ours.hardware) if ours.hardware else None
        per_node = machine_size(ours.gpus_per_node, ours.nodes, ours.world_size, hw)
        if ours.nodes is not None:
            ours.world_size = ours.nodes * per_node
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
        if hw:
            estimates, prediction = predicted(ours.task, rest, world, per_node or world, hw)
        else:
            estimates, prediction = [estimate(ours.task, rest, world, rank) for rank in ranks], None
        loading = checkpointing.describe_load(args.load, args, world) if args.load else None
    print(report(estimates, world))
    if args.fp8_format:
        print(FP8_MEMORY)
    if loading:
        print(f"Checkpoint to load: {loading}")
    if prediction:
        print(prediction_report(prediction, world, per_node or world))
    if ours.json:
        rows = [{k: v for k, v in dataclasses.asdict(e).items() if k not in ("schedule", "work")}
                | {"peak": e.peak, "work": {p: w.to_json() for p, w in e.work.items()}} for e in estimates]  # fmt: skip
        os.makedirs(os.path.dirname(ours.json) or ".", exist_ok=True)
        extra = {"predicted": prediction.to_json()} if prediction else {}
        Path(ours.json).write_text(json.dumps({"world_size": world, "ranks": rows, **extra}, indent=1))
    if prediction and not prediction.fits:
        with error_report.user_errors("explain.py"):
            raise ConfigError(f"the layout does not fit in memory: {prediction.memory_problem}")


if __name__ == "__main__":
    main()
