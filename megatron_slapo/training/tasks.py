"""What differs between pretrain_gpt.py and pretrain_bert.py: datasets, model inputs, losses.

Losses are computed here from the model's logits rather than by HF's ``labels=`` path, so that
logits left split along the vocabulary by a tensor-parallel schedule go through the
vocabulary-parallel cross-entropy (no ``B x S x V`` gather) and every model family is treated alike.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_slapo.data.datasets import SplitSizes, build_bert_datasets, build_gpt_datasets
from megatron_slapo.parallel.collectives import Group
from megatron_slapo.parallel.vocab import vocab_parallel_cross_entropy


def token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_group: Group) -> torch.Tensor:
    """Per-token cross-entropy (fp32); vocabulary-parallel when the logits hold a slice of ``vocab_size``."""
    group = tp_group if logits.size(-1) != vocab_size else None
    return vocab_parallel_cross_entropy(logits, labels, group)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


class _ModelLoss:
    """``loss``: the model's forward on a batch, then the task's ``criterion`` (engines that run
    the whole model call this; pipeline engines call ``inputs`` and ``criterion`` apart)."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.criterion(model(**self.inputs(batch)), batch)


@dataclass
class GPTTask(_ModelLoss):
    """Causal language modelling on Megatron's GPTDataset (``tokens``, ``labels``, ``loss_mask``)."""

    vocab_size: int
    tp_group: Group

    @staticmethod
    def build_datasets(args: argparse.Namespace, tokenizer: Any, sizes: SplitSizes) -> tuple:
        return build_gpt_datasets(args, tokenizer, sizes)

    @staticmethod
    def inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The model's keyword arguments for ``batch``."""
        return {"input_ids": batch["tokens"], "use_cache": False}

    def criterion(self, out: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to differentiate, and the metrics to log, from the model's output."""
        lm = masked_mean(token_losses(out.logits, batch["labels"], self.vocab_size, self.tp_group), batch["loss_mask"])
        return lm, {"lm loss": lm.detach()}


@dataclass
class BERTTask(_ModelLoss):
    """Masked LM (+ sentence-order prediction) on Megatron's BERTMaskedWordPieceDataset."""

    vocab_size: int
    tp_group: Group
    binary_head: bool = True

    @staticmethod
    def build_datasets(args: argparse.Namespace, tokenizer: Any, sizes: SplitSizes) -> tuple:
        return build_bert_datasets(args, tokenizer, sizes)

    @staticmethod
    def inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"input_ids": batch["text"], "token_type_ids": batch["types"], "attention_mask": batch["padding_mask"]}

    def criterion(self, out: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
        lm = masked_mean(token_losses(logits, batch["labels"], self.vocab_size, self.tp_group), batch["loss_mask"])
        metrics = {"lm loss": lm.detach()}
        if not self.binary_head:
            return lm, metrics
        order_logits = out.seq_relationship_logits if hasattr(out, "seq_relationship_logits") else out.sop_logits
        sop = F.cross_entropy(order_logits.float(), batch["is_random"].long())
        metrics["sop loss"] = sop.detach()
        return lm + sop, metrics
