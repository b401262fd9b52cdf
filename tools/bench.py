"""Train-step speed and peak memory of the one-device recipes against plain HF eager, side by side.

    .venv/bin/python tools/bench.py --grid cpu [--json out.json] [--plot out.png]
    .venv/bin/python tools/bench.py --grid cpu-llama   # a 4-layer Llama: llama_tp on one device
    .venv/bin/python tools/bench.py --grid gpu ...     # one H100/H200: GPT-2 124M and a ~1B Llama, bf16

A row is a model config x a recipe x a precision. The recipe (a schedule from ``schedules/``, or
``--compile`` on the unscheduled model) and plain HF train the same weights in the same process:
HF as ``from_config`` gives it (SDPA attention, eager mode, its own ``labels=`` loss), the recipe
with the trainer's loss. A step is forward, loss, backward and an AdamW step on a fixed batch;
both run at the row's precision (parameters cast to it: the dtype is the same on both sides).
Repetitions alternate between the two so that machine noise hits both alike, and the medians of
``--steps`` after ``--warmup`` are reported (the recipe compiles during warm-up). The speed-up is
HF's step time over the recipe's: above 1 the recipe is faster.

Peak memory is what a step adds at its peak above what was allocated before it: on a GPU from
the allocator's statistics, on a CPU from the allocation events torch's profiler records (each
carries the allocator's running total), measured after the timed steps.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import megatron_slapo as ms  # noqa: E402
from megatron_slapo.compat.torch_internals import allocation_events  # noqa: E402
from megatron_slapo.kernels.vocab import vocab_parallel_cross_entropy  # noqa: E402
from megatron_slapo.models.layers import transformer_layers  # noqa: E402
from megatron_slapo.parallel.random import seed  # noqa: E402
from megatron_slapo.training import recompute  # noqa: E402
from megatron_slapo.training.flops import device_peak_tflops, flops_per_token  # noqa: E402
from schedules import get_schedule  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Row:
    """One benchmarked configuration: an HF model config, a batch, a recipe, a precision."""

    model: str  # a label, e.g. "gpt2 4L h768"
    model_type: str  # transformers' config type
    sizes: tuple[tuple[str, int], ...]  # config fields (a tuple, so that the row is hashable and JSON-able)
    seq: int
    batch: int
    recipe: str  # a key of RECIPES
    dtype: str  # a key of DTYPES

    def config(self) -> transformers.PretrainedConfig:
        positions = "n_positions" if self.model_type == "gpt2" else "max_position_embeddings"
        return transformers.AutoConfig.for_model(self.model_type, **dict(self.sizes), **{positions: self.seq})


# recipe -> (schedule, --checkpoint-ratio, compile every layer): what the trainer would apply
RECIPES = {
    "gpt_fused": ("gpt_fused", None, False),
    "gpt_fused, ratio 0.5": ("gpt_fused", 0.5, False),
    "compile": ("default", None, True),
    "llama_tp": ("llama_tp", None, False),  # on one device: q|k|v and gate|up one GEMM each, F.rms_norm, chunked CE
    "llama_tp + compile": ("llama_tp", None, True),  # --schedule llama_tp --compile
}

GPT2_SMALL = (("n_layer", 4), ("n_embd", 768), ("n_head", 12))  # GPT-2's dropout: 0.1 everywhere
NO_DROPOUT = (("resid_pdrop", 0.0), ("embd_pdrop", 0.0), ("attn_pdrop", 0.0))  # as Llama-style pretraining
GPT2_124M = (("n_layer", 12), ("n_embd", 768), ("n_head", 12))
LLAMA_1B = (("hidden_size", 2048), ("intermediate_size", 5632), ("num_hidden_layers", 16),
            ("num_attention_heads", 32), ("num_key_value_heads", 8), ("vocab_size", 32000))  # fmt: skip
LLAMA_SMALL = (("hidden_size", 768), ("intermediate_size", 2048), ("num_hidden_layers", 4),
               ("num_attention_heads", 12), ("num_key_value_heads", 4), ("vocab_size", 32000))  # fmt: skip
# End of text at id 0: GPT-2's default, 50256, lies outside the tiny vocabulary (transformers warns of it)
TINY = (("n_layer", 2), ("n_embd", 64), ("n_head", 4), ("vocab_size", 512), ("bos_token_id", 0), ("eos_token_id", 0))

GRIDS = {  # the CPU config (2 cores), the GPU configs (one H100), a smoke test
    "cpu": [*(Row("gpt2 4L h768", "gpt2", GPT2_SMALL, 512, 2, recipe, dtype)
              for dtype in DTYPES for recipe in ("gpt_fused", "gpt_fused, ratio 0.5")),
            *(Row("gpt2 4L h768 no dropout", "gpt2", GPT2_SMALL + NO_DROPOUT, 512, 2, "gpt_fused", dtype)
              for dtype in DTYPES)],
    "gpu": [Row("gpt2 124M", "gpt2", GPT2_124M, 1024, 8, "gpt_fused", "bf16"),
            Row("gpt2 124M", "gpt2", GPT2_124M, 1024, 8, "compile", "bf16"),
            Row("gpt2 124M no dropout", "gpt2", GPT2_124M + NO_DROPOUT, 1024, 8, "gpt_fused", "bf16"),
            Row("llama 1B", "llama", LLAMA_1B, 2048, 4, "llama_tp", "bf16"),
            Row("llama 1B", "llama", LLAMA_1B, 2048, 4, "compile", "bf16"),
            Row("llama 1B", "llama", LLAMA_1B, 2048, 4, "llama_tp + compile", "bf16"),
            Row("gpt2 124M", "gpt2", GPT2_124M, 1024, 8, "gpt_fused, ratio 0.5", "bf16")],
    "cpu-llama": [Row("llama 4L h768", "llama", LLAMA_SMALL, 512, 2, "llama_tp", dtype) for dtype in DTYPES],
    "tiny": [Row("gpt2 tiny", "gpt2", TINY, 32, 2, "gpt_fused", "fp32")],
}  # fmt: skip


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _models(row: Row) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(plain HF, the recipe) with the same weights, at the row's precision."""
    config = row.config()
    seed(0)  # the default generator, and the model-parallel stream that attention dropout runs on
    hf = transformers.AutoModelForCausalLM.from_config(config).to(_device(), DTYPES[row.dtype]).train()
    schedule, ratio, compile_layers = RECIPES[row.recipe]
    sch = ms.create_schedule(copy.deepcopy(hf))
    get_schedule(schedule).apply(sch, config, argparse.Namespace(sequence_parallel=False))
    layers = transformer_layers(sch.mod, config.num_hidden_layers)
    if ratio is not None:
        recompute.apply(sch, argparse.Namespace(recompute_granularity=None, checkpoint_ratio=ratio), layers, 1)
    if compile_layers:
        for path in layers:
            sch[path].compile()
    return hf, ms.build(sch, init_weights=False).train()


def _step(model: torch.nn.Module, ids: torch.Tensor, hf_loss: bool) -> Callable[[], None]:
    """One training step on ``ids``: HF's own ``labels=`` loss, or the trainer's (next-token labels)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    labels = ids.roll(-1, dims=1)

    def run() -> None:
        if hf_loss:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            loss = vocab_parallel_cross_entropy(model(input_ids=ids, use_cache=False).logits, labels, None).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return run


def _timed(run: Callable[[], None]) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def step_memory(run: Callable[[], None]) -> float:
    """MiB a step adds at its peak above what was allocated before it (see the module docstring)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = allocation_events(prof)  # (start, size, total); size < 0: a free
    if not events:
        return 0.0
    events.sort()
    _, first_size, first_total = events[0]
    return (max(total for _, _, total in events) - (first_total - first_size)) / 2**20


def _ids(row: Row, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (row.batch, row.seq), generator=generator).to(_device())


def measure(row: Row, warmup: int, steps: int, peak_tflops: float | None) -> dict:
    """Time both sides of ``row`` interleaved; add their step memory; derive the rates."""
    hf, ours = _models(row)
    ids = _ids(row, hf.config.vocab_size)
    runs = {"hf": _step(hf, ids, hf_loss=True), "scheduled": _step(ours, ids, hf_loss=False)}
    times: dict[str, list[float]] = {side: [] for side in runs}
    for i in range(warmup + steps):
        for side, run in runs.items():
            elapsed = _timed(run)
            if i >= warmup:
                times[side].append(elapsed)
    step = {side: statistics.median(t) for side, t in times.items()}
    memory = {side: step_memory(run) for side, run in runs.items()}
    tokens = row.batch * row.seq
    flops = flops_per_token(transformers.AutoModelForCausalLM, row.config(), row.seq) * tokens
    result = {**dataclasses.asdict(row), "device": device_name(), "warmup": warmup, "steps": steps}
    for side in runs:
        tflops = flops / step[side] / 1e12
        result[side] = {"step_ms": step[side] * 1e3, "tokens_per_s": tokens / step[side], "tflops": tflops,
                        "mfu": tflops / peak_tflops if peak_tflops else None, "step_memory_mib": memory[side],
                        "step_ms_all": [t * 1e3 for t in times[side]]}  # fmt: skip
    result["speedup"] = step["hf"] / step["scheduled"]
    result["memory_ratio"] = memory["scheduled"] / memory["hf"] if memory["hf"] > 0 else None  # a tiny model: 0
    return result


def device_name() -> str:
    """The GPU's name, or the CPU's cores and torch's threads: where a benchmark ran."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def table(results: list[dict]) -> str:
    """The results as a Markdown table."""
    lines = ["| model | seq x batch | precision | recipe | HF ms | recipe ms | speed-up | HF tokens/s | recipe tokens/s "
             "| recipe TFLOP/s | recipe MFU | HF step MiB | recipe step MiB | memory ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        hf, ours = r["hf"], r["scheduled"]
        mfu = f"{ours['mfu']:.1%}" if ours["mfu"] is not None else "n/a"
        lines.append(f"| {r['model']} | {r['seq']} x {r['batch']} | {r['dtype']} | {r['recipe']} | {hf['step_ms']:.0f} | "
                     f"{ours['step_ms']:.0f} | {r['speedup']:.2f}x | {hf['tokens_per_s']:.0f} | "
                     f"{ours['tokens_per_s']:.0f} | {ours['tflops']:.3f} | {mfu} | {hf['step_memory_mib']:.0f} | "
                     f"{ours['step_memory_mib']:.0f} | {_ratio(r['memory_ratio'])} |")  # fmt: skip
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Speed-up and memory ratio per row, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['recipe']}, {r['dtype']}" for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(results), 4.5))
    for ax, key, title in ((axes[0], "speedup", "speed-up over HF eager (x)"),
                           (axes[1], "memory_ratio", "step memory / HF eager's")):  # fmt: skip
        values = [r[key] or 0.0 for r in results]  # n/a: no bar
        ax.bar(range(len(values)), values, color="tab:blue")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=60, ha="right")
        ax.set_title(title)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"tools/bench.py on {results[0]['device']}")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side; the median is reported")
    p.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU (default: known GPUs)")
    p.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    p.add_argument("--plot", metavar="PNG", help="write the speed-up and memory ratio per row")
    a = p.parse_args()
    if a.warmup < 2:
        p.error("--warmup must be at least 2: a compiled recipe compiles its forward, then its backward")
    results = []
    for row in GRIDS[a.grid]:  # each row reported, and the JSON rewritten, as soon as it is measured
        results.append(measure(row, a.warmup, a.steps, device_peak_tflops(a.peak_tflops)))
        print(table(results[-1:]).splitlines()[-1], flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    print(f"\ntools/bench.py --grid {a.grid} on {results[0]['device']}: median of {a.steps} steps after {a.warmup}\n")
    print(table(results))
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
