"""Find the fastest way to train a model on this machine: TP, PP, DP, sequence parallelism, ZeRO
stage, micro-batch size and recompute, searched with explain's estimates and short real trials.

    .venv/bin/python tools/autotune.py --nproc-per-node 2 -- --num-layers 4 --hidden-size 256 \\
        --num-attention-heads 8 --seq-length 256 --global-batch-size 16
    .venv/bin/python tools/autotune.py --nproc-per-node 8 --tp 1,2,4,8 --micro-batch-sizes 1,2,4 \\
        --memory-budget-gib 70 --results tune.jsonl -- <pretrain_gpt.py flags>

The flags after ``--`` are the trainer's and stay fixed (the model, the data, the global batch);
the tuner chooses the rest, from the candidates given (every one by default):

- ``tp``: tensor-parallel sizes dividing the ranks and the attention heads (without ``--schedule``
  each point gets the schedule the trainer gives it: the family's tensor-parallel one, ``gpt_tp``
  for GPT-2, at TP > 1);
- ``pp``: pipeline sizes dividing the remaining ranks and the layers;
- ``cp``: context-parallel sizes (``--context-parallel-size``: each rank runs ``1/C`` of every
  sequence, exchanging keys and values in every attention layer), only those ``--cp`` lists (default
  1, none): they divide the remaining ranks and the sequence into ``2C`` chunks, not with ZeRO-2/3
  (DeepSpeed), each rank's tokens dividing over TP under sequence parallelism. The exchange makes a
  step slower wherever the activations fit without it, so they are worth a search's trials only for
  long sequences; when no point fits the memory budget the tuner says so and suggests ``--cp``;
- ``sp``: sequence parallelism, where TP > 1;
- ``zero``: 0 megatron-core's DDP, 1 its distributed optimizer (ZeRO-1), 2 and 3 DeepSpeed's
  ZeRO-2/3 (without a pipeline); above 0 only with data parallelism;
- ``mbs``: micro-batch sizes dividing the global batch per data-parallel rank;
- ``recompute``: none, selective (attention cores) or full (every layer);
- ``fp8``: the FP8 recipes ``--fp8`` lists (``--fp8-recipe``; none: bf16 alone), only with ``--bf16`` among
  the fixed flags; a point's value is ``FORMAT/RECIPE``, the format ``--fp8-format`` among the fixed
  flags (default hybrid). Given, FP8 is asked for and the default candidates are both recipes, else
  none (FP8 rounds otherwise: a user opts in).

Each point is explained first (:mod:`megatron_slapo.estimates.estimate`, in this process, no
training): points over ``--memory-budget-gib`` (default: the GPU's memory, else this machine's
RAM shared by the ranks; 90% of it) and points dominated by a cheaper one are never run
(:mod:`megatron_slapo.tuning.search`). The rest run as trials, one ``torchrun`` each
(:mod:`megatron_slapo.tuning.trial`), whose JSON results go, a line each, to ``--results``
(default ``autotune-results.jsonl``), with each point's plan: run the same command again and it
resumes, explaining and running nothing it did before (a result, an error included, is not run
again: delete its line to retry it; the plans are made afresh when the code explain runs changed).
The last lines are the best configuration, its schedule, and its command, to run from the
repository root as printed: ``.venv/bin/torchrun`` under the repository's environment, else this
Python's ``-m torch.distributed.run`` (the trials launch the same way).
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import hashlib
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from megatron_slapo.arguments.parser import parse_args  # noqa: E402
from megatron_slapo.errors import ConfigError  # noqa: E402
from megatron_slapo.estimates import hardware  # noqa: E402
from megatron_slapo.kernels.fp8 import RECIPES  # noqa: E402
from megatron_slapo.training import error_report  # noqa: E402
from megatron_slapo.training.settings import resolve_settings  # noqa: E402
from megatron_slapo.tuning import prediction  # noqa: E402
from megatron_slapo.tuning.search import Cost, ring_traffic, search  # noqa: E402
from megatron_slapo.tuning.space import Point, Space  # noqa: E402

RECOMPUTE = {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--recompute-granularity", "full", "--recompute-method", "uniform"]}  # fmt: skip
ZERO = {0: [], 1: ["--use-distributed-optimizer"], 2: ["--engine", "deepspeed", "--zero-stage", "2"],
        3: ["--engine", "deepspeed", "--zero-stage", "3"]}  # fmt: skip
CHOSEN = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel", "--engine",
          "--zero-stage", "--deepspeed-config", "--use-distributed-optimizer", "--micro-batch-size",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--checkpoint-ratio",
          "--num-layers-per-virtual-pipeline-stage", "--expert-model-parallel-size", "--context-parallel-size",
          "--fp8-recipe")  # fmt: skip


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _switches(text: str) -> list[bool]:
    if not set(text.split(",")) <= {"on", "off"}:
        raise argparse.ArgumentTypeError(f"{text!r}: give off, on or off,on")
    return [v == "on" for v in text.split(",")]


def hardware_of(ours: argparse.Namespace) -> tuple[hardware.Hardware | None, int]:
    """``--hardware``'s profile and devices per node (None: tune on this machine); with a GPU
    profile the tensor-parallel candidates default to sizes within a node (NVLink's), as
    Megatron-LM advises. Checks the flags that need it have it."""
    needs = [flag for flag, given in (("--predict-only", ours.predict_only), ("--trials", ours.trials is not None),
                                      ("--gpus-per-node", ours.gpus_per_node), ("--nodes", ours.nodes != 1)) if given]  # fmt: skip
    if not ours.hardware:
        if needs:
            raise ConfigError(f"{', '.join(needs)}: give --hardware too (what to predict on)")
        return None, ours.nproc_per_node
    hw = hardware.load(ours.hardware)
    per_node = ours.gpus_per_node or (hardware.GPUS_PER_NODE if hw.compute_units is None else ours.nproc_per_node)
    if ours.nodes < 1 or per_node < 1 or (ours.trials is not None and ours.trials < 1):
        raise ConfigError("--nodes, --gpus-per-node and --trials must be at least 1")
    if ours.trials is not None and (ours.predict_only or ours.nodes * per_node != ours.nproc_per_node):
        raise ConfigError(f"--trials runs here on --nproc-per-node {ours.nproc_per_node} ranks: not with --predict-only, "
                          "and --nodes x --gpus-per-node must be those ranks")  # fmt: skip
    if ours.trials is None and not ours.predict_only:
        raise ConfigError("--hardware: give --predict-only (rank by prediction) or --trials K (run the K best here)")
    ours.tp = ours.tp or [t for t in range(1, per_node + 1) if per_node % t == 0]
    return hw, per_node


def check_candidates(ours: argparse.Namespace) -> None:
    """ConfigError naming the first of the tuner's own flags whose value is out of range."""
    least = {"--nproc-per-node": ([ours.nproc_per_node], 1), "--tp": (ours.tp or [], 1), "--pp": (ours.pp or [], 1),
             "--ep": (ours.ep or [], 1), "--cp": (ours.cp, 1),
             "--micro-batch-sizes": (ours.micro_batch_sizes, 1), "--zero": (ours.zero, 0),
             "--warmup": ([ours.warmup], 0), "--steps": ([ours.steps], 1), "--trial-timeout": ([ours.trial_timeout], 1),
             "--confirm-rounds": ([ours.confirm_rounds], 0)}  # fmt: skip
    for flag, (values, minimum) in least.items():
        if any(v < minimum for v in values):
            shown = ",".join(map(str, values))
            raise ConfigError(f"{flag} {shown}: each must be >= {minimum}" if len(values) > 1
                              else f"{flag} {shown} must be >= {minimum}")  # fmt: skip
    if any(z not in ZERO for z in ours.zero):
        raise ConfigError(f"--zero {','.join(map(str, ours.zero))}: choose from {','.join(map(str, ZERO))}")
    unknown = [r for r in ours.recompute if r not in RECOMPUTE]
    if unknown:
        raise ConfigError(f"--recompute {','.join(unknown)}: choose from {','.join(RECOMPUTE)}")
    if ours.memory_budget_gib is not None and not ours.memory_budget_gib > 0:
        raise ConfigError(f"--memory-budget-gib {ours.memory_budget_gib} must be > 0")


def fp8_candidates(ours: argparse.Namespace, base: list[str]) -> list[str]:
    """Set ``ours.fp8`` to the points' FP8 values ("none", or "FORMAT/RECIPE": see the module
    docstring) and return the fixed flags less ``--fp8-format``, which each point then carries."""
    fixed, fmt, i = [], None, 0
    while i < len(base):
        flag, _, value = base[i].partition("=")
        if flag == "--fp8-format":
            fmt, i = (value, i + 1) if value else (base[i + 1] if i + 1 < len(base) else "", i + 2)
        else:
            fixed, i = [*fixed, base[i]], i + 1
    recipes = ours.fp8 or (list(RECIPES) if fmt else ["none"])
    unknown = [r for r in recipes if r not in ("none", *RECIPES)]
    if unknown:
        raise ConfigError(f"--fp8 {','.join(unknown)}: choose from none,{','.join(RECIPES)}")
    if fmt and "none" in recipes:
        raise ConfigError("--fp8 none with --fp8-format among the fixed flags: drop --fp8-format to try bf16 alone too")
    if recipes != ["none"] and "--bf16" not in fixed:
        raise ConfigError(f"--fp8 {','.join(recipes)}: FP8 needs --bf16 among the trainer's flags")
    ours.fp8 = [r if r == "none" else f"{fmt or 'hybrid'}/{r}" for r in recipes]
    return fixed


def gpt_space(world: int, layers: int | None, heads: int | None, global_batch: int, ask: argparse.Namespace,
              experts: int | None = None, seq: int | None = None) -> Space:  # fmt: skip
    """The tuner's space for a decoder of ``layers`` and ``heads`` on ``world`` ranks (where the
    flags leave them to the HF config, explain refuses what does not divide). An MoE model of
    ``experts`` experts also gets expert-parallel sizes that divide them and the data-parallel
    ranks (all of them unless ``--ep`` lists some), on the engines that run them (not ZeRO-2/3).
    The context-parallel sizes ``--cp`` lists are kept where the trainer takes them for sequences
    of ``seq`` tokens (``validation.py``'s rules: see the module docstring)."""

    def dp(point: Point) -> int:  # the ranks holding copies of the weights: data- x context-parallel
        return world // (point["tp"] * point["pp"])

    def data(point: Point) -> int:  # the ranks reading different micro-batches
        return dp(point) // point["cp"]

    def tokens(point: Point) -> int | None:  # of a sequence, on each context-parallel rank
        return seq // point["cp"] if seq else None

    def divides(size: int, total: int | None) -> bool:
        return total is None or total % size == 0

    space = Space()
    space.symbol("tp", [t for t in ask.tp or range(1, world + 1) if world % t == 0 and divides(t, heads)])
    space.symbol("pp", lambda p: [s for s in ask.pp or range(1, world // p["tp"] + 1)
                                  if divides(s, world // p["tp"]) and divides(s, layers)])  # fmt: skip
    space.symbol("cp", lambda p: [c for c in ask.cp if dp(p) % c == 0 and divides(2 * c, seq)])
    space.symbol("sp", lambda p: [v for v in (False, True) if v in ask.sp and (not v or (
        p["tp"] > 1 and divides(p["tp"], tokens(p))))])  # fmt: skip
    space.symbol("zero", lambda p: [z for z in ask.zero if z == 0 or (dp(p) > 1 and (z < 2 or (
        p["pp"] == 1 and p["cp"] == 1)))])  # fmt: skip
    space.symbol("ep", lambda p: [e for e in ask.ep or range(1, dp(p) + 1) if e == 1 or (
        experts and experts % e == 0 and dp(p) % e == 0 and p["zero"] < 2)])  # fmt: skip
    space.symbol("mbs", lambda p: [m for m in ask.micro_batch_sizes if (global_batch // data(p)) % m == 0])
    space.symbol("recompute", ask.recompute)
    if (getattr(ask, "fp8", None) or ["none"]) != ["none"]:  # bf16 alone: the points (and results) of before
        space.symbol("fp8", ask.fp8)
    space.constraint(lambda p: global_batch % data(p) == 0, "the global batch divides over the data-parallel ranks")
    return space


def flags_of(point: Point) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(point["tp"]), "--pipeline-model-parallel-size", str(point["pp"]),
             "--micro-batch-size", str(point["mbs"]), *ZERO[point["zero"]], *RECOMPUTE[point["recompute"]]]  # fmt: skip
    if point.get("ep", 1) > 1:  # a dense model's points (and results kept from before) have none
        flags += ["--expert-model-parallel-size", str(point["ep"])]
    if point.get("cp", 1) > 1:  # likewise: a point of one rank per sequence keeps its flags (and results)
        flags += ["--context-parallel-size", str(point["cp"])]
    if point.get("fp8", "none") != "none":  # "FORMAT/RECIPE" (fp8_candidates)
        fmt, recipe = point["fp8"].split("/")
        flags += ["--fp8-format", fmt, "--fp8-recipe", recipe]
    return [*flags, "--sequence-parallel"] if point["sp"] else flags


def default_budget(nproc: int) -> int:
    """90% of one GPU's memory, else of this machine's RAM shared by its ``nproc`` ranks."""
    if torch.cuda.is_available():
        return int(0.9 * torch.cuda.get_device_properties(0).total_memory)
    return int(0.9 * psutil.virtual_memory().total / nproc)


def _planner(task: str, base: list[str], world: int):
    def plan(flags: list[str]) -> Cost:
        from tools.explain import explain  # the training stack, seconds to import: a resumed search needs none

        estimates = explain(task, [*base, *flags], world)
        return Cost(max(e.peak for e in estimates), max(e.flops for e in estimates),
                    max(ring_traffic(e.comm) for e in estimates))  # fmt: skip

    return plan


def _predictor(task: str, base: list[str], world: int, per_node: int, hw: hardware.Hardware):
    def plan(flags: list[str]) -> tuple[int, int, prediction.Prediction]:
        from tools.explain import predicted

        estimates, step = predicted(task, [*base, *flags], world, per_node, hw, shallow=True)
        worst = max(estimates, key=lambda e: e.peak)
        return worst.peak, worst.rank, step

    return plan


def multi_node_command(task: str, nodes: int, per_node: int, base: list[str], flags: list[str]) -> str:
    """The training command of a configuration for each of ``nodes`` nodes of ``per_node`` devices."""
    if nodes == 1:
        return command(task, per_node, base, flags)
    rendezvous = shlex.join([*launcher(), "--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint"])
    rest = shlex.join([f"--nproc_per_node={per_node}", f"pretrain_{task}.py", *base, *flags])
    return f"{rendezvous} $MASTER_ADDR:29500 {rest}"  # the address each node's shell fills in


def predicted_search(ours: argparse.Namespace, base: list[str], trial: list[str], space: Space, hw: hardware.Hardware,
                     per_node: int, budget: int) -> None:  # fmt: skip
    """``--predict-only``: the best five layouts by predicted step time, as commands; ``--trials K``:
    the K best run here, each reported predicted against measured."""
    world = ours.nodes * per_node
    ranked = prediction.rank_points(space, flags_of, _predictor(ours.task, trial, world, per_node, hw), budget)
    fit = [p for p in ranked if p.prediction]
    over = sum(p.why.startswith("over memory") for p in ranked)
    print(f"> predicted {len(ranked)} configurations on {hw.name} ({ours.nodes} node(s) x {per_node}): {len(fit)} fit "
          f"in {budget / 2**30:.1f} GiB, {over} do not, {len(ranked) - len(fit) - over} refused")  # fmt: skip
    if not fit:
        closest = min((p for p in ranked if p.why.startswith("over memory")), key=lambda p: p.why, default=None)
        raise ConfigError(
            "no configuration fits in memory" + (f" (e.g. {prediction.describe(closest)})" if closest else "")
        )
    if ours.trials is None:
        for i, p in enumerate(fit[:5], 1):
            print(f"> {i}. {prediction.describe(p)}")
            print(multi_node_command(ours.task, ours.nodes, per_node, base, p.flags))
        return
    run = trial_runner(ours.task, trial, world, ours.warmup, ours.steps, ours.trial_timeout)
    measured = []
    for p in fit[: ours.trials]:
        result = run(p.flags)
        seconds = result.get("step_seconds")
        shown = f"{seconds:.4g} s measured" if seconds else f"failed: {result.get('error')}"
        print(f"> {prediction.describe(p)}; {shown}" + (f" ({p.seconds / seconds:.2f} of it)" if seconds else ""))
        if seconds:
            measured.append((seconds, p))
    if not measured:
        raise ConfigError("no trial ran: see the errors above")
    seconds, best = min(measured, key=lambda m: m[0])
    print(f"> best measured: {' '.join(f'{k}={v}' for k, v in best.point.items())}: {seconds * 1e3:.1f} ms per step")
    print(command(ours.task, world, base, best.flags))


def plan_version() -> str:
    """What a point's plan depends on besides the flags: the code explain runs (this repository's
    package and schedules) and the libraries' versions. A resumed tuner re-explains when it changed."""
    digest = hashlib.sha256()
    sources = [*ROOT.glob("megatron_slapo/**/*.py"), *ROOT.glob("schedules/*.py"), ROOT / "tools" / "explain.py"]
    for path in sorted(sources):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    for package in ("torch", "transformers", "megatron-core", "deepspeed"):
        try:
            digest.update(f"{package}=={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            pass
    return digest.hexdigest()[:16]


def launcher() -> list[str]:
    """torchrun as this tuner runs it, written to run from the repository root in any shell: the
    repository's ``.venv/bin/torchrun`` when this is that environment's Python, else this Python
    with ``-m torch.distributed.run`` (never a bare ``torchrun``: it may not be on the PATH)."""
    venv_bin = ROOT / ".venv" / "bin"
    if Path(sys.executable).parent.resolve() == venv_bin.resolve() and (venv_bin / "torchrun").exists():
        return [".venv/bin/torchrun"]
    return [sys.executable, "-m", "torch.distributed.run"]


def trial_runner(task: str, base: list[str], nproc: int, warmup: int, steps: int, timeout: int):
    """``run(flags)``: one trial of ``base + flags`` on ``nproc`` ranks, its JSON result (or its error)."""

    def run(flags: list[str]) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [*launcher(), "--standalone", f"--nproc_per_node={nproc}", "-m", "megatron_slapo.tuning.trial",
                   "--out", out, "--task", task, "--warmup", str(warmup), "--steps", str(steps),
                   "--", *base, *flags, "--tensorboard-dir", os.path.join(tmp, "tb")]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            # run from the root (the launcher's path is relative to it); a session of its own: at the
            # timeout, torchrun and every worker go, not torchrun alone
            trial = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)  # fmt: skip
            try:
                _, stderr = trial.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(trial.pid, signal.SIGKILL)
                trial.communicate()
                return {"error": f"no result within --trial-timeout {timeout} s"}
            except BaseException:  # the tuner stopped (Ctrl-C): its trial goes with it
                os.killpg(trial.pid, signal.SIGKILL)
                trial.wait()
                raise
            if os.path.exists(out):
                with open(out) as f:
                    return json.load(f)
            errors = [line for line in stderr.splitlines() if "Error" in line] or stderr.splitlines()[-1:]
            return {"error": f"exit status {trial.returncode}: " + (errors[0].strip()[:300] if errors else "no output")}

    return run


def command(task: str, nproc: int, base: list[str], flags: list[str]) -> str:
    """The training command of a configuration, to run from the repository root as printed."""
    return shlex.join([*launcher(), "--standalone", f"--nproc_per_node={nproc}", f"pretrain_{task}.py", *base, *flags])


def schedule_of(task: str, flags: list[str]) -> str:
    """The schedule the trainer runs with ``flags``, and why (``--schedule``, or the default for
    the model type at the point's tensor-parallel size)."""
    settings, _ = resolve_settings(parse_args(task, flags))
    return f"{settings.schedule}, {settings.schedule_reason}"


def parser() -> argparse.ArgumentParser:
    """The tuner's own flags: the candidates and how to run the trials (the trainer's go after ``--``)."""
    p = argparse.ArgumentParser(
        prog="autotune.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--task", choices=("gpt",), default="gpt")
    p.add_argument("--nproc-per-node", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--tp", type=_ints)
    p.add_argument("--pp", type=_ints)
    p.add_argument("--ep", type=_ints, help="expert-parallel sizes of an MoE model (default: all that divide)")
    p.add_argument("--cp", type=_ints, default=[1], help="context-parallel sizes, for long sequences (default: 1 only)")
    p.add_argument("--sp", type=_switches, default=[False, True], help="off,on")
    p.add_argument("--zero", type=_ints, default=[0, 1, 2, 3])
    p.add_argument("--micro-batch-sizes", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--recompute", type=lambda t: t.split(","), default=list(RECOMPUTE))
    p.add_argument("--fp8", type=lambda t: t.split(","),
                   help="FP8 recipes to try: none,tensorwise,rowwise (default: none; both with --fp8-format given)")  # fmt: skip
    p.add_argument("--memory-budget-gib", type=float)
    p.add_argument("--results", default="autotune-results.jsonl")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trial-timeout", type=int, default=600)
    p.add_argument("--exhaustive", action="store_true", help="run every configuration (Slapo's tuner), to compare")
    p.add_argument("--hardware", help="predict on this profile (explain.py --hardware's) instead of timing here")
    p.add_argument("--nodes", type=int, default=1, help="with --hardware: the cluster's nodes")
    p.add_argument("--gpus-per-node", type=int, help="with --hardware: devices per node (default 8 on a GPU profile)")
    p.add_argument("--predict-only", action="store_true", help="with --hardware: rank by prediction, run nothing")
    p.add_argument("--trials", type=int, help="with --hardware: run the K best-predicted configurations here")
    p.add_argument("--confirm-rounds", type=int, default=2,
                   help="rounds in which the trials within 10%% of the fastest run again; the best median wins")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> None:
    ours, base = parser().parse_known_args(argv)
    if "--" in base:  # the trainer's flags: after it (or, unknown to the tuner, before it)
        base.remove("--")
    world = ours.nproc_per_node
    with error_report.user_errors("autotune.py"):
        hw, per_node = hardware_of(ours)
        if hw is not None:
            world = ours.nodes * per_node
        given = [f for f in base if f.split("=")[0] in CHOSEN]
        if given:
            raise ConfigError(f"{', '.join(given)}: the tuner chooses these; give the candidates instead (--help)")
        check_candidates(ours)
        base = fp8_candidates(ours, base)
        trial = [*base, "--train-iters", str(ours.warmup + ours.steps), "--eval-iters", "0"]
        # the model's shape, where the flags (or the embedded run) give it
        args = parse_args(ours.task, trial, prog="autotune.py")
        space = gpt_space(world, args.num_layers, args.num_attention_heads, args.global_batch_size, ours,
                          args.num_experts, args.seq_length)  # fmt: skip
        if not len(space):
            raise ConfigError("the space is empty: no candidate combination divides the ranks, heads, layers and batch")
        budget = int(ours.memory_budget_gib * 2**30) if ours.memory_budget_gib else default_budget(world)
        if hw is not None:
            budget = int(ours.memory_budget_gib * 2**30) if ours.memory_budget_gib else int(0.9 * hw.memory_gib * 2**30)
            return predicted_search(ours, base, trial, space, hw, per_node, budget)
        print(f"> searching {len(space)} configurations on {world} ranks; memory budget {budget / 2**30:.2f} GiB "
              f"per rank; results in {ours.results}", flush=True)  # fmt: skip
        outcome = search(space, flags_of, _planner(ours.task, trial, world),
                         trial_runner(ours.task, trial, world, ours.warmup, ours.steps, ours.trial_timeout), budget,
                         results=ours.results, exhaustive=ours.exhaustive, confirm=ours.confirm_rounds,
                         setting={"task": ours.task, "nproc": world, "warmup": ours.warmup, "steps": ours.steps,
                                  "flags": trial}, plan_version=plan_version())  # fmt: skip
    total = len(outcome.candidates)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(outcome.counts.items()))
    if not ours.exhaustive:
        print(f"> explained {total} configurations: {total - outcome.plans_kept} now, {outcome.plans_kept} kept in "
              f"{ours.results}")  # fmt: skip
    print(f"> {outcome.ran + outcome.resumed} trials of {total} configurations ({outcome.ran} run now, "
          f"{outcome.resumed} from {ours.results}); skipped without a run: {skipped or 'none'}. "
          f"An exhaustive search (Slapo's tuner) runs all {total}.")  # fmt: skip
    if outcome.ignored:
        print(f"> {outcome.ignored} results in {ours.results} were measured with other fixed flags, ranks or steps: "
              "not used")  # fmt: skip
    for reason in ("refused", "not explained"):
        points = [c for c in outcome.candidates if c.reason == reason]
        for c in points[:5]:
            print(f"> {reason}: {' '.join(f'{k}={v}' for k, v in c.point.items())}: {c.why}")
        if len(points) > 5:
            print(f"> ... and {len(points) - 5} more {reason}")
    if outcome.best is None:
        if outcome.counts.get("over the memory budget") == total and ours.cp == [1]:
            print("> every configuration is over the memory budget: --cp 1,2,4 (say) lets each rank hold 1/C of "
                  "every sequence's activations", file=sys.stderr)  # fmt: skip
        print("> no configuration trained: see the errors above", file=sys.stderr)
        sys.exit(1)
    best = outcome.best
    print(f"> best: {' '.join(f'{k}={v}' for k, v in best.point.items())}: {best.seconds * 1e3:.1f} ms per step, "
          f"{best.per_second:,.0f} {best.result['unit']}/s (median of {len(best.times)} runs; schedule "
          f"{schedule_of(ours.task, [*base, *best.flags])})")  # fmt: skip
    print(command(ours.task, world, base, best.flags))


if __name__ == "__main__":
    main()
