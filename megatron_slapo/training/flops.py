"""Model FLOPs and device peaks, for TFLOP/s and MFU in the log line.

FLOPs per token of a training step (forward + backward = 3 x forward), counting matrix multiplies:
``6 N`` for the N non-embedding parameters, ``12 L h s`` for attention scores and context
(``QK^T`` and ``AV``), and ``6 h V`` for the LM head. This is the torchtitan/PaLM accounting; for
GPT it equals Megatron's ``72 b s L h^2 (1 + s/6h + V/12hL)`` up to the FFN width and biases.
"""

from __future__ import annotations

import torch
from torch import nn

# Dense bf16 peak TFLOP/s by device name fragment (the MFU denominator, as torchtitan uses).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, embedding and LM-head parameters) of the unsharded model (ties counted once)."""
    params = {id(p): p for p in model.parameters()}
    embeddings = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        embeddings[id(head.weight)] = head.weight  # counted in the 6 h V term instead
    return sum(p.numel() for p in params.values()), sum(p.numel() for p in embeddings.values())


def flops_per_token(model: nn.Module, num_layers: int, hidden: int, seq_length: int, vocab: int) -> float:
    total, embedding = count_parameters(model)
    return 6 * (total - embedding) + 12 * num_layers * hidden * seq_length + 6 * hidden * vocab


def device_peak_tflops(override: float | None = None) -> float | None:
    """The peak to compute MFU against; None on CPUs and unknown devices (MFU is then not reported)."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)
