"""Train a small HF GPT-2 with tensor parallelism from ``schedules/gpt_tp.py``.

    .venv/bin/torchrun --nproc_per_node 2 examples/train_gpt_tp.py --steps 40

The model is created on the meta device, scheduled (vocabulary-parallel embedding and loss,
column/row-parallel attention and MLP), and built shard-locally; it then trains on the bytes of a
text that ships with Python (the ``argparse`` module's source), so it runs anywhere without data
or network. This is the library on its own, without the trainer (``pretrain_gpt.py``) around it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time

import torch
import torch.distributed as dist
import transformers

import megatron_slapo as ms
from megatron_slapo import parallel
from schedules import gpt_tp


def corpus_batches(batch: int, seq: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Random windows of a byte-level corpus (vocabulary 256, divisible by any small TP size)."""
    text = torch.tensor(list(inspect.getsource(argparse).encode("utf-8")), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - seq, (steps, batch), generator=gen)
    return [torch.stack([text[s : s + seq] for s in row.tolist()]) for row in starts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    tp = int(os.environ.get("WORLD_SIZE", 1))  # every rank of this demo is one tensor-parallel group
    parallel.initialize(tensor_parallel=tp, seed=args.seed)
    rank = dist.get_rank()

    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.seq_length, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    sch = ms.create_schedule(model)
    gpt_tp.apply(sch, config)
    model = ms.build(sch, seed=args.seed)
    local = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"GPT-2 ({config.n_layer} layers, hidden {config.n_embd}) with tensor parallelism {tp}: "
            f"{local:,} parameters on each rank"
        )

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = corpus_batches(args.micro_batch_size, args.seq_length, args.steps, args.seed)
    start = time.perf_counter()
    for step, ids in enumerate(data, 1):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 5 == 0 or step == 1):
            tokens_per_s = step * ids.numel() / (time.perf_counter() - start)
            print(f"step {step:4d} | lm loss {loss.item():.4f} | {tokens_per_s:,.0f} tokens/s")
    parallel.destroy()


if __name__ == "__main__":
    main()
