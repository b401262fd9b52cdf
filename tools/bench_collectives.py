"""Step time of every tensor-parallel schedule, two ways in one run: as shipped, and with one
input-gradient all-reduce per column-parallel projection (how the schedules communicated before
``ParallelRegionInput``: 4-5 backward all-reduces per layer instead of Megatron's 2).

    .venv/bin/torchrun --nproc_per_node 2 tools/bench_collectives.py [--hidden-size 256 --num-layers 4 --seq-length 128 ...]

Each measurement is a forward and backward of one micro-batch (fp32, dropout off, the
vocabulary-parallel loss of predicting each token itself), the median of
``--steps`` after ``--warmup``; both variants run in the same process, interleaved step by step so
that machine noise hits both alike. Rank 0 prints a Markdown table: milliseconds per step, the
ratio (per-projection / shipped: above 1 is the speed-up) and the all-reduce bytes per step.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import megatron_slapo as ms  # noqa: E402
from megatron_slapo import parallel  # noqa: E402
from megatron_slapo.kernels.vocab import vocab_parallel_cross_entropy  # noqa: E402
from megatron_slapo.parallel.comm_log import CommLog  # noqa: E402
from megatron_slapo.plans.styles import ColumnParallel, ParallelRegionInput, apply_plan  # noqa: E402
from schedules import bert_tp, gpt_neo_tp, gpt_tp, llama_tp, opt_tp  # noqa: E402


def _configs(a: argparse.Namespace) -> dict[str, tuple[transformers.PretrainedConfig, dict]]:
    """schedule -> (HF config of the benchmarked size, its plan); dropout off, so both variants agree.
    GPT-2's and GPT-Neo's end-of-text token is id 0 here: their configs' default, 50256, lies outside
    a --vocab-size below GPT-2's (transformers warns of it)."""
    h, n, heads, v, s = a.hidden_size, a.num_layers, a.num_attention_heads, a.vocab_size, a.seq_length
    end_of_text = {"bos_token_id": 0, "eos_token_id": 0}
    return {
        "gpt_tp": (transformers.GPT2Config(vocab_size=v, n_positions=s, n_embd=h, n_layer=n, n_head=heads,
                                           resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **end_of_text), gpt_tp.PLAN),
        "gpt_neo_tp": (transformers.GPTNeoConfig(vocab_size=v, max_position_embeddings=s, hidden_size=h, num_layers=n,
                                                 num_heads=heads, attention_types=[[["global"], n]], resid_dropout=0,
                                                 embed_dropout=0, attention_dropout=0, **end_of_text),
                       gpt_neo_tp.PLAN),
        "opt_tp": (transformers.OPTConfig(vocab_size=v, max_position_embeddings=s, hidden_size=h, num_hidden_layers=n,
                                          ffn_dim=4 * h, num_attention_heads=heads, word_embed_proj_dim=h, dropout=0,
                                          attention_dropout=0), opt_tp.PLAN),
        "llama_tp": (transformers.LlamaConfig(vocab_size=v, max_position_embeddings=s, hidden_size=h,
                                              intermediate_size=4 * h, num_hidden_layers=n, num_attention_heads=heads,
                                              num_key_value_heads=heads), llama_tp.PLAN),
        "bert_tp": (transformers.BertConfig(vocab_size=v, max_position_embeddings=s, hidden_size=h,
                                            num_hidden_layers=n, num_attention_heads=heads, intermediate_size=4 * h,
                                            hidden_dropout_prob=0, attention_probs_dropout_prob=0),
                    bert_tp.plan("bert")),
    }  # fmt: skip


def per_projection(plan: dict) -> dict:
    """The plan with every column-parallel projection reducing its own input gradient."""

    def before(placement):
        if isinstance(placement, tuple):
            return tuple(before(p) for p in placement if not isinstance(p, ParallelRegionInput))
        if isinstance(placement, ParallelRegionInput):
            return ()
        if isinstance(placement, ColumnParallel):
            return dataclasses.replace(placement, reduce_input_grad=True)
        return placement

    return {pattern: before(p) for pattern, p in plan.items()}


def _build(config: transformers.PretrainedConfig, plan: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if config.model_type == "bert" else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    sch = ms.create_schedule(model, parallel.tensor_parallel_group())
    apply_plan(sch, plan)
    return ms.build(sch).train()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    def run() -> float:
        dist.barrier()
        start = time.perf_counter()
        logits = model(ids).logits  # split along the vocabulary: the trainer's loss
        vocab_parallel_cross_entropy(logits, ids, parallel.tensor_parallel_group()).mean().backward()
        dist.barrier()
        return (time.perf_counter() - start) * 1e3

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--schedules", nargs="+", default=None, help="default: all")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world < 2:
        p.error("run under torchrun with 2 or more processes: they are the tensor-parallel ranks")
    parallel.initialize(tensor_parallel=world)
    ids = torch.randint(0, a.vocab_size, (a.micro_batch_size, a.seq_length), generator=torch.Generator().manual_seed(0))
    rows = []
    for name, (config, plan) in _configs(a).items():
        if a.schedules and name not in a.schedules:
            continue
        runs = {"per-projection": _step(_build(config, per_projection(plan)), ids),
                "shipped": _step(_build(config, plan), ids)}  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in runs}
        comm: dict[str, int] = {}
        for i in range(a.warmup + a.steps):
            for variant, run in runs.items():
                log = CommLog().install() if i == 0 else None
                elapsed = run()
                if log is not None:
                    log.uninstall()
                    comm[variant] = sum(v for k, v in log.take().items() if k.startswith("all_reduce"))
                if i >= a.warmup:
                    times[variant].append(elapsed)
        before, after = (statistics.median(times[k]) for k in ("per-projection", "shipped"))
        rows.append(f"| {name} | {before:.1f} | {after:.1f} | {before / after:.3f} | "
                    f"{comm['per-projection']:,} | {comm['shipped']:,} |")  # fmt: skip
    if dist.get_rank() == 0:
        print(f"TP{world}, hidden {a.hidden_size}, {a.num_layers} layers, {a.num_attention_heads} heads, "
              f"seq {a.seq_length}, micro-batch {a.micro_batch_size}, fp32; median of {a.steps} steps "
              f"(forward + backward) after {a.warmup}\n")  # fmt: skip
        print(
            "| schedule | per-projection ms | shipped ms | speed-up | per-projection all-reduce B | shipped all-reduce B |"
        )
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
    parallel.destroy()


if __name__ == "__main__":
    main()
