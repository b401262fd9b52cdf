"""Model FLOPs and device peaks, for TFLOP/s and MFU in the log line.

FLOPs per token of a training step are 3 x those of the forward (the backward does twice its
work), and the forward's are counted by torch's ``FlopCounterMode`` over one sequence on the meta
device: every matrix multiply and attention product as the model really runs them, so a layer
shared across depth (ALBERT) counts once per use, and a model family needs no formula of its own.
Image models are counted the same way, per image.
For GPT it agrees with Megatron's ``72 b s L h^2 (1 + s/6h + V/12hL)`` up to the FFN width and the
full (not causal-halved) attention scores that both count.
"""

from __future__ import annotations

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from megatron_slapo.tracing.meta_fixes import experts_on_meta

# Dense bf16 peak TFLOP/s by device name fragment (the MFU denominator, as torchtitan uses).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "V100": 125.0}


def _training_flops(auto_class: type, config: transformers.PretrainedConfig, **inputs: torch.Tensor) -> float:
    """Training FLOPs of the unsharded model ``auto_class.from_config(config)`` on ``inputs`` (meta tensors)."""
    with torch.device("meta"):
        model = auto_class.from_config(config)
    with torch.no_grad(), experts_on_meta(model), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return 3 * counter.get_total_flops()


def flops_per_token(
    auto_class: type, config: transformers.PretrainedConfig, seq_length: int, decoder_length: int | None = None
) -> float:
    """Training FLOPs per token of a language model, over one sequence of ``seq_length`` (an
    encoder-decoder's: per encoder token, its decoder running ``decoder_length`` tokens)."""
    inputs = {"input_ids": torch.zeros(1, seq_length, dtype=torch.long, device="meta")}
    if decoder_length:
        inputs["decoder_input_ids"] = torch.zeros(1, decoder_length, dtype=torch.long, device="meta")
    return _training_flops(auto_class, config, **inputs) / seq_length


def flops_per_image(auto_class: type, config: transformers.PretrainedConfig, height: int, width: int) -> float:
    """Training FLOPs per image of an image model (convolutions counted as the GEMMs they are)."""
    pixels = torch.zeros(1, config.num_channels, height, width, device="meta")
    return _training_flops(auto_class, config, pixel_values=pixels)


def device_peak_tflops(override: float | None = None) -> float | None:
    """The peak to compute MFU against; None on CPUs and unknown devices (MFU is then not reported)."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)
