"""The Slapo paper's benchmark suites, on the ranks at hand: Figure 7 (systems side by side) and
Figure 9 (the ablation, one optimisation added at a time), GPT-2, tokens per second.

    .venv/bin/torchrun --nproc_per_node 2 tools/bench_suites.py --suite fig7 [--json out.json] [--plot out.png]
    .venv/bin/torchrun --nproc_per_node 2 tools/bench_suites.py --suite fig9 [-- --num-layers 8 --hidden-size 512 ...]

Every system trains the same GPT-2 size (flags after ``--`` override the small default) with the
same global batch, in this one ``torchrun`` session, for ``--iters`` steps; a system's step time is
the median of its steps after ``--warmup`` (compilation happens there), from the trainer's own
``iteration-time``. The systems run in ``--rounds`` rounds, each round every system once in turn, so
that machine noise reaches them alike; the median over rounds is reported, with the speed-up over
the first system (HF eager). Figure 7's systems:

- HF eager: the model as HF gives it, data-parallel (DDP).
- DeepSpeed ZeRO-3: the same model handed to DeepSpeed, as its users would out of the box.
- megatron-core GPTModel: Megatron's own GPT of the same size (local layers, no Transformer
  Engine), TP over every rank, with torch's AdamW and the trainer's gradient clipping; random tokens
  of the same shape; a step timed as the slowest rank's, around forward, backward and the update.
- gpt_tp (+ SP): the schedule, on megatron-core's engine.

Figure 9 (every step on ``--engine ddp``) adds, in turn: the kernels (``gpt_fused``: one-kernel GeLU, every layer compiled), a
recompute ratio of 0.5, attention and MLP tensor parallelism (gpt_tp's plan without its embedding
and head entries), the vocabulary-parallel embedding and head (all of gpt_tp), sequence parallelism.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from megatron_slapo import parallel  # noqa: E402
from megatron_slapo.arguments.parser import parse_args  # noqa: E402
from megatron_slapo.arguments.validation import validate_args  # noqa: E402
from megatron_slapo.compat.torch_internals import foreach_mul_  # noqa: E402
from megatron_slapo.engines.optimizer import global_norm  # noqa: E402
from megatron_slapo.plans.kernel_swap import swap_in_kernels  # noqa: E402
from megatron_slapo.plans.sequence import plan_schedule  # noqa: E402
from megatron_slapo.training.loop import pretrain  # noqa: E402
from megatron_slapo.training.plan import language_task  # noqa: E402
from megatron_slapo.training.settings import resolve_settings  # noqa: E402
from schedules import SCHEDULES, gpt_tp  # noqa: E402
from tools.plot import read_scalars  # noqa: E402

SIZE = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
        "--micro-batch-size", "4", "--global-batch-size", "16"]  # fmt: skip

# gpt_tp's plan less its vocabulary-parallel embedding and head (Figure 9's "attention/MLP TP" step),
# a schedule of this process only (registered by run_suite)
LAYERS_ONLY = "gpt_tp, layers only"

TP = ["--tensor-model-parallel-size", "{world}"]
DDP = ["--engine", "ddp"]  # Figure 9 keeps one engine: each step adds one optimisation only
SUITES = {  # system -> trainer flags ("mcore": megatron-core's own GPTModel)
    "fig7": {
        "HF eager (DDP)": ["--engine", "ddp", "--schedule", "default"],
        "DeepSpeed ZeRO-3": ["--engine", "deepspeed", "--zero-stage", "3", "--schedule", "default"],
        "megatron-core GPTModel (TP)": "mcore",
        "gpt_tp (TP)": ["--schedule", "gpt_tp", *TP],
        "gpt_tp (TP + SP)": ["--schedule", "gpt_tp", *TP, "--sequence-parallel"],
    },
    "fig9": {
        "HF eager (DDP)": ["--engine", "ddp", "--schedule", "default"],
        "+ kernels": ["--engine", "ddp", "--schedule", "gpt_fused"],
        "+ recompute ratio 0.5": ["--engine", "ddp", "--schedule", "gpt_fused", "--checkpoint-ratio", "0.5"],
        "+ attention/MLP TP": [*DDP, "--schedule", LAYERS_ONLY, *TP, "--compile", "--checkpoint-ratio", "0.5"],
        "+ embedding TP": [*DDP, "--schedule", "gpt_tp", *TP, "--compile", "--checkpoint-ratio", "0.5"],
        "+ SP": [*DDP, "--schedule", "gpt_tp", *TP, "--compile", "--checkpoint-ratio", "0.5", "--sequence-parallel"],
    },
}


def trainer_step_seconds(flags: list[str], common: list[str], iters: int, warmup: int) -> float:
    """Median ``iteration-time`` of a trainer run after ``warmup`` steps."""
    with tempfile.TemporaryDirectory() as tmp:
        tb = os.path.join(tmp, "tb")
        box = [tb]
        dist.broadcast_object_list(box, src=0)  # one directory for every rank: the last writes TensorBoard
        argv = [*common, *flags, "--train-iters", str(iters), "--log-interval", str(iters), "--eval-iters", "0"]
        pretrain("gpt", [*argv, "--tensorboard-dir", box[0]])
        last = dist.get_world_size() - 1
        times = [read_scalars(box[0])["iteration-time"] if dist.get_rank() == last else None]
        dist.broadcast_object_list(times, src=last)
        dist.barrier()  # the last rank has read the files before rank 0 removes the directory
    return statistics.median(v for step, v in times[0].items() if step > warmup)


def mcore_step_seconds(common: list[str], iters: int, warmup: int) -> float:
    """Megatron's own GPTModel, TP over every rank, the trainer's sizes and batch: median step time."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = parse_args("gpt", [*common, "--tensor-model-parallel-size", str(dist.get_world_size())])
    world = dist.get_world_size()
    validate_args(args, world)
    parallel.initialize(world, 1, seed=args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    settings, hf_config = resolve_settings(args)
    hf, _, _ = language_task(args, settings, hf_config, None)  # the trainer's GPT-2: sizes, padded vocabulary
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TransformerConfig(
        num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head, hidden_dropout=hf.resid_pdrop,
        attention_dropout=hf.attn_pdrop, tensor_model_parallel_size=world, use_cpu_initialization=device.type == "cpu",
        params_dtype=torch.float32,
    )  # fmt: skip
    vocab = hf.vocab_size
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=args.seq_length).to(device)  # fmt: skip
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=args.weight_decay)
    seq, micro = args.seq_length, args.micro_batch_size
    positions = torch.arange(seq, device=device).expand(micro, seq)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(1)  # True: masked out
    times = []
    for step in range(iters):
        generator = torch.Generator().manual_seed(step)  # the same tokens on every rank
        batches = torch.randint(0, vocab, (args.global_batch_size // micro, micro, seq + 1), generator=generator)
        batches = batches.to(device)
        dist.barrier()
        start = time.perf_counter()
        for tokens in batches:
            model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).mean().backward()
        # as the trainer: the gradient norm over the TP group (one all-reduce), clipped to --clip-grad
        norm = global_norm(params, parallel.tensor_parallel_group())
        if args.clip_grad and norm > args.clip_grad:
            foreach_mul_([p.grad for p in params], args.clip_grad / norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's, as a step waits for it
        times.append(float(elapsed))
    return statistics.median(times[warmup:])


def run_suite(suite: str, common: list[str], iters: int, warmup: int, rounds: int) -> list[dict]:
    """Every system of ``suite`` ``rounds`` times in turn; a row per system (median step time)."""
    vocabulary = ("transformer.wte", "lm_head")
    assert all(k in gpt_tp.PLAN for k in vocabulary), "gpt_tp's plan renamed its embedding or head"
    SCHEDULES[LAYERS_ONLY] = types.SimpleNamespace(
        MODEL_TYPES=gpt_tp.MODEL_TYPES,
        __doc__="gpt_tp without its embedding and head entries (tools/bench_suites.py)",
        apply=plan_schedule({k: v for k, v in gpt_tp.PLAN.items() if k not in vocabulary}, swap_in_kernels),
    )
    world = dist.get_world_size()
    seconds: dict[str, list[float]] = {name: [] for name in SUITES[suite]}
    try:
        for _ in range(rounds):
            for name, flags in SUITES[suite].items():
                if flags == "mcore":
                    seconds[name].append(mcore_step_seconds(common, iters, warmup))
                else:
                    flags = [f.format(world=world) for f in flags]
                    seconds[name].append(trainer_step_seconds(flags, common, iters, warmup))
    finally:
        del SCHEDULES[LAYERS_ONLY]
    args = parse_args("gpt", common)
    tokens = args.global_batch_size * args.seq_length
    base = statistics.median(next(iter(seconds.values())))
    return [{"suite": suite, "system": name, "ranks": world, "step_ms": statistics.median(s) * 1e3,
             "step_ms_rounds": [t * 1e3 for t in s], "tokens_per_s": tokens / statistics.median(s),
             "speedup": base / statistics.median(s)} for name, s in seconds.items()]  # fmt: skip


def table(results: list[dict]) -> str:
    lines = ["| system | ranks | step ms | tokens/s | speed-up over HF eager |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['system']} | {r['ranks']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['speedup']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2 + 1.3 * len(results), 4))
    values = [r["speedup"] for r in results]
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(values)), [r["system"] for r in results], fontsize=8, rotation=30, ha="right")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set(title=title, ylabel="speed-up over HF eager (x)")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=sorted(SUITES), required=True)
    p.add_argument("--iters", type=int, default=8, help="training steps per system and round")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (compilation happens here)")
    p.add_argument("--rounds", type=int, default=2, help="times every system runs, in turn")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("trainer", nargs=argparse.REMAINDER, help="-- flags for every system (the model size, ...)")
    a = p.parse_args()
    if a.warmup >= a.iters:
        p.error("--warmup must leave some of --iters to time")
    extra = a.trainer[1:] if a.trainer[:1] == ["--"] else a.trainer
    common = [*SIZE, *extra]
    parallel.initialize(1, 1)  # the process group; each system sets its own layout
    results = run_suite(a.suite, common, a.iters, a.warmup, a.rounds)
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
        m = parse_args("gpt", common)
        title = (f"{a.suite}: GPT-2, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
                 f"sequence {m.seq_length}, batch {m.global_batch_size} ({m.micro_batch_size} a micro-batch), "
                 f"{dist.get_world_size()} ranks on {device}")  # fmt: skip
        print(f"\ntools/bench_suites.py --suite {a.suite}; {title}\n\n{table(results)}")
        if a.json:
            revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      cwd=Path(__file__).resolve().parents[1]).stdout.strip()  # fmt: skip
            run = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "device": device, "torch": torch.__version__, "commit": revision or None, "model": title}  # fmt: skip
            Path(a.json).write_text(json.dumps({"run": run, "results": results}, indent=1))
        if a.plot:
            plot(results, a.plot, title)


if __name__ == "__main__":
    main()
