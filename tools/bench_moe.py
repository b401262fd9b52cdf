"""Expert parallelism against experts split by features: step time and bytes moved per step of a
qwen3_moe-shaped model with many small experts, every layout in one ``torchrun`` session.

    .venv/bin/torchrun --nproc_per_node 2 tools/bench_moe.py [--experts 16 --topk 2 --expert-width 128] \\
        [--iters 8 --warmup 3 --rounds 2] [--json OUT]

One model (written once as an HF config, ``--hf-config`` to the trainer) trains in each layout, on
the same global batch, for ``--iters`` steps; a layout's step time is the median of its steps after
``--warmup``, and the median over ``--rounds`` rounds (each round runs every layout once, in turn,
so that machine noise reaches them alike). The layouts, on N ranks:

- TP: ``--tensor-model-parallel-size N``, every expert split by its features (the baseline; the
  ranks see the same tokens, so the global batch is N micro-batches of one rank's size).
- EP, alltoall / allgather: ``--expert-model-parallel-size N``, whole experts per rank, the ranks
  data-parallel (each its own micro-batch); tokens reach their experts by all-to-all, or by every
  rank gathering all tokens (``--moe-token-dispatcher-type``).
- transformers' own: ``from_pretrained(distributed_config=DistributedConfig(ep_size=N, ...))`` with
  the dense part FSDP2-sharded (each rank its own micro-batch) or tensor-parallel (the same tokens,
  two micro-batches accumulated), AdamW, its own ``labels=`` loss, random tokens of the same shape.
  Its ``from_pretrained`` needs ``accelerate``; without it these rows say so and are not timed.

Step times: the trainer's ``iteration-time`` on the last rank, and for transformers the slowest
rank's (a barrier before each step; the steps end in collectives, so the ranks finish together).
Bytes: the last rank's per step, median over the timed steps; the trainer's from ``--log-comm``
(``comm-bytes/...`` in TensorBoard), transformers' counted by :class:`CollectiveBytes` with the same
rule (the tensor for all-reduce, the gathered output, the scattered input, the all-to-all's input).
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from megatron_slapo import parallel  # noqa: E402
from megatron_slapo.compat.torch_internals import TorchDispatchMode  # noqa: E402
from megatron_slapo.training.loop import pretrain  # noqa: E402
from tools.plot import read_scalars  # noqa: E402

MICRO, GLOBAL, VOCAB = 4, 8, 4096  # VOCAB: the embedded corpus's tokenizer (the trainer's data)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One benchmarked layout: trainer flags, or transformers' ``DistributedConfig`` keywords."""

    name: str
    flags: tuple[str, ...] = ()  # pretrain_gpt.py's, "{world}" replaced by the number of ranks
    hf: tuple[str, ...] = ()  # transformers' run: DistributedConfig(**{key: world for key in hf})
    shared_tokens: bool = False  # transformers: every rank trains the same tokens (TP), else its own (DP)

    def trainer_flags(self, world: int) -> list[str]:
        return [f.format(world=world) for f in self.flags]


LAYOUTS = [
    Layout("TP{world}, experts split by features", ("--tensor-model-parallel-size", "{world}")),
    Layout("EP{world}, alltoall", ("--expert-model-parallel-size", "{world}", "--moe-token-dispatcher-type", "alltoall")),
    Layout("EP{world}, allgather",
           ("--expert-model-parallel-size", "{world}", "--moe-token-dispatcher-type", "allgather")),
    Layout("transformers EP{world} + FSDP2", hf=("ep_size", "fsdp_size")),
    Layout("transformers EP{world} + TP{world}", hf=("ep_size", "tp_size"), shared_tokens=True),
]  # fmt: skip


def model_config(a: argparse.Namespace) -> transformers.PretrainedConfig:
    """The benchmarked qwen3_moe (the sizes of :func:`parser`): 8 query and 4 key/value heads, every layer MoE."""
    return transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=a.hidden, intermediate_size=4 * a.expert_width, moe_intermediate_size=a.expert_width,
        num_experts=a.experts, num_experts_per_tok=a.topk, num_hidden_layers=a.layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=a.hidden // 8, vocab_size=VOCAB, max_position_embeddings=a.seq,
        tie_word_embeddings=False,
    )  # fmt: skip


def trainer_flags(config_dir: str, seq: int) -> list[str]:
    """Every trainer layout's common flags: the model from ``config_dir``, the batch, no dropout (as HF's Qwen3)."""
    return ["--model-type", "qwen3_moe", "--schedule", "auto", "--hf-config", config_dir, "--seq-length", str(seq),
            "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-comm"]  # fmt: skip


def hf_unavailable() -> str | None:
    """Why transformers' own expert parallelism cannot run here, or None."""
    if importlib.util.find_spec("accelerate") is None:
        return "transformers' from_pretrained(distributed_config=...) requires accelerate (pip install accelerate)"
    return None


# c10d operator -> (the counted tensor: an argument's position, or -1 for the output; the name shown)
_COUNTED = {
    "c10d::allreduce_": (0, "all_reduce"), "c10d::broadcast_": (0, "broadcast"),
    "c10d::_allgather_base_": (0, "all_gather"), "c10d::allgather_": (0, "all_gather"),
    "c10d::_reduce_scatter_base_": (1, "reduce_scatter"), "c10d::reduce_scatter_": (1, "reduce_scatter"),
    "c10d::alltoall_base_": (1, "all_to_all"),
    "_c10d_functional::all_reduce": (0, "all_reduce"), "_c10d_functional::all_gather_into_tensor": (-1, "all_gather"),
    "_c10d_functional::reduce_scatter_tensor": (0, "reduce_scatter"),
    "_c10d_functional::all_to_all_single": (0, "all_to_all"),
}  # fmt: skip


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return value.numel() * value.element_size() if torch.is_tensor(value) else 0


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes of every collective operator dispatched while active, by kind. Unlike
    ``--log-comm`` (which wraps ``torch.distributed``'s Python functions) it sees the functional
    collectives that DTensor and transformers' expert dispatch call, and FSDP2's too."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        counted = _COUNTED.get(func.name())
        if counted:
            index, shown = counted
            self.bytes[shown] += _nbytes(out if index < 0 else args[index])
        return out


def trainer_run(flags: list[str], iters: int) -> dict[str, dict[int, float]]:
    """Train ``iters`` steps with ``flags``; the last rank's TensorBoard scalars, on every rank."""
    with tempfile.TemporaryDirectory() as tmp:
        box = [os.path.join(tmp, "tb")]
        dist.broadcast_object_list(box, src=0)  # one directory for every rank: the last writes TensorBoard
        pretrain("gpt", [*flags, "--train-iters", str(iters), "--log-interval", str(iters), "--eval-iters", "0",
                         "--tensorboard-dir", box[0]])  # fmt: skip
        last = dist.get_world_size() - 1
        scalars = [read_scalars(box[0]) if dist.get_rank() == last else None]
        dist.broadcast_object_list(scalars, src=last)
        dist.barrier()  # the last rank has read the files before rank 0 removes the directory
    return scalars[0]


def trainer_sample(flags: list[str], iters: int, warmup: int) -> dict:
    """Median step seconds and bytes per step (by collective) after ``warmup`` steps."""
    scalars = trainer_run(flags, iters)
    timed = [step for step in scalars["iteration-time"] if step > warmup]
    comm = {tag.removeprefix("comm-bytes/"): values for tag, values in scalars.items() if tag.startswith("comm-bytes/")}
    by_kind = {kind: statistics.median(values[s] for s in timed) for kind, values in comm.items()}
    total = statistics.median(sum(values[s] for values in comm.values()) for s in timed)
    return {"step_s": statistics.median(scalars["iteration-time"][s] for s in timed), "bytes": total,
            "bytes_by_kind": {k: v for k, v in by_kind.items() if v}}  # fmt: skip


def hf_sample(layout: Layout, model_dir: str, seq: int, iters: int, warmup: int) -> dict:
    """transformers' own distributed training of the model in ``model_dir``: median step and bytes."""
    from transformers.distributed import DistributedConfig

    world, rank = dist.get_world_size(), dist.get_rank()
    config = DistributedConfig(**{key: world for key in layout.hf})
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config,
                                                              dtype=torch.float32).train()  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per_rank = GLOBAL // world if not layout.shared_tokens else GLOBAL  # sequences a rank trains per step
    steps, sent = [], []
    for step in range(iters):
        generator = torch.Generator().manual_seed(step)  # the same global batch on every rank
        batch = torch.randint(0, VOCAB, (GLOBAL, seq), generator=generator)
        mine = batch if layout.shared_tokens else batch[rank * per_rank : (rank + 1) * per_rank]
        counter = CollectiveBytes()
        dist.barrier()
        start = time.perf_counter()
        with counter:
            for micro in mine.split(MICRO):  # gradient accumulation over micro-batches, mean loss
                (model(input_ids=micro, labels=micro).loss * micro.shape[0] / per_rank).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        steps.append(float(elapsed))
        sent.append(dict(counter.bytes))
    del model, optimizer
    last = [sent[warmup:] if rank == world - 1 else None]
    dist.broadcast_object_list(last, src=world - 1)
    kinds = sorted({k for s in last[0] for k in s})
    by_kind = {kind: statistics.median(s.get(kind, 0) for s in last[0]) for kind in kinds}
    return {"step_s": statistics.median(steps[warmup:]), "bytes": statistics.median(sum(s.values()) for s in last[0]),
            "bytes_by_kind": by_kind}  # fmt: skip


def run(layouts: list[Layout], model_dir: str, seq: int, iters: int, warmup: int, rounds: int) -> list[dict]:
    """Every layout ``rounds`` times in turn; a row per layout, with its ratios against the first."""
    world = dist.get_world_size()
    skip = hf_unavailable()
    samples: dict[str, list[dict]] = {layout.name: [] for layout in layouts}
    for _ in range(rounds):
        for layout in layouts:
            if layout.hf and skip:
                continue
            if layout.hf:
                samples[layout.name].append(hf_sample(layout, model_dir, seq, iters, warmup))
            else:
                flags = [*trainer_flags(model_dir, seq), *layout.trainer_flags(world)]
                samples[layout.name].append(trainer_sample(flags, iters, warmup))
    rows = []
    for layout in layouts:
        row: dict[str, Any] = {"layout": layout.name.format(world=world), "ranks": world}
        got = samples[layout.name]
        if not got:
            rows.append({**row, "skipped": skip})
            continue
        step = statistics.median(s["step_s"] for s in got)
        # bytes: the median over rounds; by collective: the last round's
        row.update(step_ms=step * 1e3, step_ms_rounds=[s["step_s"] * 1e3 for s in got],
                   tokens_per_s=GLOBAL * seq / step, bytes_per_step=statistics.median(s["bytes"] for s in got),
                   bytes_by_kind=got[-1]["bytes_by_kind"])  # fmt: skip
        rows.append(row)
    base = rows[0]
    for row in rows:
        if "step_ms" in row:
            row["time_vs_tp"] = row["step_ms"] / base["step_ms"]
            row["bytes_vs_tp"] = row["bytes_per_step"] / base["bytes_per_step"]
    return rows


def table(rows: list[dict]) -> str:
    """The rows as Markdown: step time, bytes per step, both as ratios against the first row."""
    lines = ["| layout | step ms | tokens/s | step time / TP's | MiB moved per step (last rank) | bytes / TP's "
             "| by collective (MiB; under 0.01 left out) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['layout']} | not run: {r['skipped']} | | | | | |")
            continue
        kinds = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(r["bytes_by_kind"].items()) if v >= 2**20 / 100)
        lines.append(f"| {r['layout']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | {r['time_vs_tp']:.2f}x | "
                     f"{r['bytes_per_step'] / 2**20:.2f} | {r['bytes_vs_tp']:.2f}x | {kinds} |")  # fmt: skip
    return "\n".join(lines)


def revision() -> str | None:
    """The checkout's commit, and whether the tree that ran differs from it."""
    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return f"{commit} with uncommitted changes" if commit and dirty.stdout.strip() else commit or None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_moe.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="decoder layers, each an MoE block")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (8 heads of hidden / 8)")
    p.add_argument("--seq", type=int, default=256, help="sequence length")
    p.add_argument("--experts", type=int, default=16, help="routed experts per layer")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--expert-width", type=int, default=128, help="each expert's FFN width")
    p.add_argument("--iters", type=int, default=8, help="training steps per layout and round")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--rounds", type=int, default=2, help="times every layout runs, in turn")
    p.add_argument("--json", metavar="FILE", help="write the rows, the command, date and device as JSON")
    return p


def check(a: argparse.Namespace, p: argparse.ArgumentParser, world: int) -> None:
    """Bad input, one line before any compute."""
    if a.warmup >= a.iters:
        p.error("--warmup must leave some of --iters to time")
    if min(a.layers, a.hidden, a.seq, a.experts, a.topk, a.expert_width, a.rounds) < 1 or a.warmup < 0:
        p.error("the sizes, --topk and --rounds must be positive, --warmup not negative")
    if a.hidden % 16:
        p.error(f"--hidden {a.hidden} must be a multiple of 16 (8 heads of an even size)")
    if a.topk > a.experts:
        p.error(f"--topk {a.topk} is more than --experts {a.experts}")
    if world < 2 or a.experts % world or GLOBAL % world:
        p.error(f"run it on ranks that divide --experts {a.experts} and the batch of {GLOBAL} (torchrun "
                f"--nproc_per_node 2); this launch has {world}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    check(a, p, int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's
    parallel.initialize(1, 1)  # the process group; each layout sets its own
    world = dist.get_world_size()
    box = [tempfile.mkdtemp(prefix="bench-moe-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model_dir = box[0]
    config = model_config(a)
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)  # transformers loads weights
    dist.barrier()
    try:
        rows = run(LAYOUTS, model_dir, a.seq, a.iters, a.warmup, a.rounds)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(model_dir, ignore_errors=True)
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
        model = (f"qwen3_moe, {a.layers} layers, hidden {a.hidden}, {a.experts} experts of width {a.expert_width}, "
                 f"top-{a.topk}, sequence {a.seq}, global batch {GLOBAL} ({MICRO} a micro-batch), fp32")  # fmt: skip
        print(f"\ntools/bench_moe.py: {model}; {world} ranks on {device}; median of {a.iters - a.warmup} steps "
              f"after {a.warmup}, over {a.rounds} rounds\n\n{table(rows)}", flush=True)  # fmt: skip
        if a.json:
            info = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "device": device, "load_average_1_5_15_min": os.getloadavg(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "commit": revision(), "model": model}  # fmt: skip
            Path(a.json).write_text(json.dumps({"run": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
