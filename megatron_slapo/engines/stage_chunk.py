"""A pipeline stage as megatron-core's schedules drive it, and what those schedules can run.

megatron-core's schedules call ``set_input_tensor`` with what the previous stage sent, then the
chunk's forward, and send its output on. Activations travel in Megatron's ``[s, b, h]`` layout
(HF models are batch-first, so the chunk transposes at both ends) and in ``pipeline_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_slapo.errors import ConfigError
from megatron_slapo.pipeline import PipelineStages


class StageChunk(nn.Module):
    """One pipeline stage (a "model chunk") as megatron-core's schedules drive it."""

    def __init__(self, stage: nn.Module, first: bool, last: bool, config: Any) -> None:
        """Wrap ``stage``; ``first``/``last``: whether it takes the model's inputs or returns its output.
        A later stage's inputs are the model's inputs it recomputes from plus the one received value."""
        from megatron.core.enums import ModelType

        super().__init__()
        self.stage, self.first, self.last, self.config = stage, first, last, config
        self.model_type = ModelType.encoder_or_decoder  # a decoder-only or encoder-only stack
        self.input_tensor: torch.Tensor | None = None
        names = [n.name for n in stage.graph.nodes if n.op == "placeholder"] if not first else []
        self.input_names, self.received = set(names[:-1]), names[-1] if names else None

    def set_input_tensor(self, tensors: list[torch.Tensor | None] | torch.Tensor | None) -> None:
        """Called by the schedule before each forward with what the previous stage sent."""
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, **inputs: Any) -> Any:
        """Run the stage on the model's inputs (first stage) or on those it needs plus what the previous
        stage sent (``[s, b, h]``, Megatron's layout, turned back into HF's batch-first); a middle
        stage returns its one activation in Megatron's layout and the pipeline dtype."""
        if self.first:
            out = self.stage(**inputs)
        else:
            kept = {k: v for k, v in inputs.items() if k in self.input_names}
            out = self.stage(**kept, **{self.received: self.input_tensor.transpose(0, 1)})
        if self.last:
            return out
        return out[0].transpose(0, 1).to(self.config.pipeline_dtype).contiguous()


def check_plan(model: PipelineStages) -> None:
    """What megatron-core's schedules can run: one activation through each cut (the p2p buffers
    are one ``[s, b, h]`` tensor), and weights shared only by the first and the last stage (the
    embedding group joins only those ranks)."""
    plan, last = model.plan, len(model.stages) - 1
    for path, values in zip(plan.cut_paths, plan.crossing, strict=True):
        if len(values) != 1:
            raise ConfigError(
                f"cut_pipeline_stage at {path!r}: {len(values)} values cross it ({', '.join(values)}); "
                "megatron-core's pipeline sends one activation per cut: cut between transformer layers"
            )
    for name, used in sorted(plan.tied.items()):
        if not set(used) <= {0, last}:
            raise ConfigError(
                f"{name} is used by pipeline stages {used}; only the first and the last may share weights"
            )
