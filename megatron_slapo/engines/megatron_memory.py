"""What megatron-core's engine holds per rank: :func:`megatron_state` counts the bytes of weights,
gradient buffers and optimizer state (``MegatronEngine.memory_report`` and ``tools/explain.py``
both use it)."""

from __future__ import annotations

import argparse

from megatron_slapo.engines.optimizer import half_precision, megatron_fp32_grads


def megatron_state(args: argparse.Namespace, count: int, dp: int) -> dict[str, int]:
    """Bytes of ``count`` weights on a rank of ``dp`` data-parallel ones: the weights in the
    training dtype; the gradient buffers in fp32 or that dtype (:func:`megatron_fp32_grads`);
    AdamW's fp32 moments, and with --bf16/--fp16 the fp32 main weights, a DP shard of it all with
    the distributed optimizer. :meth:`MegatronEngine.memory_report`'s, and ``tools/explain.py``'s."""
    half = half_precision(args) is not None
    optimizer = count * 4 * (3 if half else 2)
    return {"params": count * (2 if half else 4), "grads": count * (4 if megatron_fp32_grads(args) else 2),
            "optimizer": optimizer // dp if args.use_distributed_optimizer else optimizer}  # fmt: skip
