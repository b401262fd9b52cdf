"""What differs between pretrain_{gpt,bert,t5,vision}.py: datasets, model inputs, losses.

Losses are computed here from the model's logits rather than by HF's ``labels=`` path, so that
logits left split along the vocabulary by a tensor-parallel schedule go through the
vocabulary-parallel cross-entropy (no ``B x S x V`` gather) and every model family is treated alike.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_slapo.data.datasets import (
    Corpus,
    SplitSizes,
    build_bert_datasets,
    build_gpt_datasets,
    build_t5_datasets,
)
from megatron_slapo.data.embedded import EmbeddedData
from megatron_slapo.data.images import SPLITS, PatternImages
from megatron_slapo.errors import ConfigError
from megatron_slapo.kernels.vocab import vocab_parallel_cross_entropy
from megatron_slapo.models.vocabulary import Vocabulary
from megatron_slapo.parallel.collectives import Group
from megatron_slapo.parallel.context import ContextParallel
from megatron_slapo.training.moe_loss import LoadBalancingLoss


@dataclass(frozen=True)
class LanguageData:
    """What a language task reads its tokens with and from: the tokenizer, the vocabulary's sizes,
    the corpus its datasets are built from, and the embedded corpus when no data flag was given
    (whose files then stand in for the data and tokenizer flags)."""

    tokenizer: Any
    vocab: Vocabulary
    corpus: Corpus
    embedded: EmbeddedData | None

    def arguments(self) -> dict[str, Any]:
        """The Megatron arguments this data decided: the embedded corpus's data and tokenizer files,
        the vocabulary's true and padded sizes (for the checkpoint's record of the run's arguments)."""
        decided: dict[str, Any] = {}
        if self.embedded:
            decided.update(data_path=[self.embedded.prefix], tokenizer_type=self.embedded.tokenizer_type,
                           vocab_file=self.embedded.vocab_file, merge_file=self.embedded.merge_file)  # fmt: skip
        return {**decided, "true_vocab_size": self.vocab.true_size, "padded_vocab_size": self.vocab.padded_size}


def token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp_group: Group) -> torch.Tensor:
    """Per-token cross-entropy (fp32); vocabulary-parallel when the logits hold a slice of ``vocab_size``."""
    group = tp_group if logits.size(-1) != vocab_size else None
    return vocab_parallel_cross_entropy(logits, labels, group)


def document_attention(tokens: torch.Tensor, eod: int | None, implementation: str) -> torch.Tensor:
    """The 4D ``[batch, 1, seq, seq]`` attention mask of a GPT batch, in the form the HF attention
    ``implementation`` takes as given: boolean (True: attend) for ``sdpa``, additive for ``eager``.

    With ``eod`` (``--reset-attention-mask``) each token attends only to the earlier tokens of its
    own document, Megatron's mask: no token after an end-of-document token sees it or anything
    before it. Built here from the tokens, on their device, rather than by megatron-core's dataset
    (``create_attention_mask``), which would load an S x S tensor per sample. Without ``eod``, the
    plain causal mask: passing it explicitly matters with ``--reset-position-ids`` alone, as HF
    would otherwise infer packed documents from the restarting positions and mask across them,
    which Megatron's flag does not do.
    """
    batch, seq = tokens.shape
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    if eod is not None:
        ends = (tokens == eod).long()
        document = ends.cumsum(1) - ends  # end-of-document tokens before each position
        allowed = allowed & (document[:, :, None] == document[:, None, :])
    allowed = allowed.expand(batch, seq, seq).unsqueeze(1)
    if implementation == "sdpa":
        return allowed
    if implementation == "eager":
        zero = torch.zeros((), dtype=torch.float32, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(torch.float32).min)
    raise ConfigError(f"--reset-attention-mask / --reset-position-ids need the model's attention to take a 4D mask "
                      f"(sdpa or eager), not {implementation!r}")  # fmt: skip


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def context_parallel_mean(values: torch.Tensor, mask: torch.Tensor,
                          cp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The masked mean over a sequence split between context-parallel ranks, each holding
    ``values`` of its tokens: what to differentiate here, and the mean (the same on every rank).

    The sums and token counts are added across the ranks (one all-reduce, no gradient). Each rank
    differentiates its own tokens' share of the mean times the number of ranks: the engines
    average gradients over the data-parallel x context-parallel ranks, which brings it back to the
    gradient of the mean (Megatron's loss function scales by ``--context-parallel-size`` too)."""
    mask = mask.float()
    local = (values * mask).sum()
    totals = torch.stack([local.detach(), mask.sum()])
    dist.all_reduce(totals, group=cp.group)
    count = totals[1].clamp(min=1.0)
    return local * cp.size / count, totals[0] / count


class _ModelLoss:
    """``loss``: the model's forward on a batch, then the task's ``criterion`` (engines that run
    the whole model call this; pipeline engines call ``inputs`` and ``criterion`` apart)."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.criterion(model(**self.inputs(batch)), batch)


@dataclass
class GPTTask(_ModelLoss):
    """Causal language modelling on Megatron's GPTDataset (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``).

    With ``--reset-position-ids`` / ``--reset-attention-mask`` the model gets the dataset's
    position ids and a 4D attention mask (:func:`document_attention`, per document of end token
    ``eod``); ``attention`` is the model's ``config._attn_implementation``, which decides the
    mask's form. ``--eod-mask-loss`` acts through the dataset's ``loss_mask``. ``load_balancing``:
    an MoE model's auxiliary loss (``moe_loss.py``), added with its coefficient when on.
    ``context``: under ``--context-parallel-size``, the model gets this rank's part of every
    sequence at its positions (and no mask: its attention sees the whole sequence causally), and
    the loss is the mean over the whole sequence (:func:`context_parallel_mean`).
    """

    vocab_size: int
    tp_group: Group
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod: int | None = None
    attention: str = "sdpa"
    load_balancing: LoadBalancingLoss | None = None
    context: ContextParallel | None = None

    def __post_init__(self) -> None:
        if (self.reset_position_ids or self.reset_attention_mask) and self.eod is None:
            raise ConfigError("--reset-position-ids / --reset-attention-mask need a tokenizer with an end-of-document "
                              "token")  # fmt: skip

    @staticmethod
    def build_datasets(args: argparse.Namespace, data: LanguageData, sizes: SplitSizes) -> tuple:
        return build_gpt_datasets(args, data.tokenizer, data.corpus, sizes)

    def inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The model's keyword arguments for ``batch``."""
        tokens = batch["tokens"]
        inputs: dict[str, Any] = {"input_ids": tokens, "use_cache": False}
        if self.context is not None:
            cp = self.context
            positions = (cp.local(batch["position_ids"]) if self.reset_position_ids else
                         cp.token_index(tokens.size(1), tokens.device).expand(tokens.size(0), -1))  # fmt: skip
            inputs.update(input_ids=cp.local(tokens), position_ids=positions)
        elif self.reset_position_ids or self.reset_attention_mask:
            # Positions always go with a 4D mask: OPT, say, would otherwise derive them from the mask.
            inputs["position_ids"] = batch["position_ids"]
            eod = self.eod if self.reset_attention_mask else None
            inputs["attention_mask"] = document_attention(batch["tokens"], eod, self.attention)
        if self.load_balancing is not None:  # HF records each router's logits
            inputs["output_router_logits"] = True
        return inputs

    def criterion(self, out: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to differentiate, and the metrics to log, from the model's output: the language
        modelling loss, plus the load-balancing loss times its coefficient when it is on."""
        if self.context is not None:  # the trainer refuses the auxiliary loss with it
            cp = self.context
            losses = token_losses(out.logits, cp.local(batch["labels"]), self.vocab_size, self.tp_group)
            lm, mean = context_parallel_mean(losses, cp.local(batch["loss_mask"]), cp)
            return lm, {"lm loss": mean}
        lm = masked_mean(token_losses(out.logits, batch["labels"], self.vocab_size, self.tp_group), batch["loss_mask"])
        if self.load_balancing is None:
            return lm, {"lm loss": lm.detach()}
        aux = self.load_balancing(out.router_logits, batch["tokens"].numel())
        return lm + self.load_balancing.coefficient * aux, {"lm loss": lm.detach(), "load balancing loss": aux.detach()}


@dataclass
class BERTTask(_ModelLoss):
    """Masked LM (+ sentence-order prediction) on Megatron's BERTMaskedWordPieceDataset."""

    vocab_size: int
    tp_group: Group
    binary_head: bool = True

    @staticmethod
    def build_datasets(args: argparse.Namespace, data: LanguageData, sizes: SplitSizes) -> tuple:
        return build_bert_datasets(args, data.tokenizer, data.corpus, sizes)

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


@dataclass
class T5Task(_ModelLoss):
    """Span corruption on Megatron's T5MaskedWordPieceDataset: the encoder reads the text with each
    masked span replaced by a sentinel, the decoder predicts the sentinels and their spans."""

    vocab_size: int
    tp_group: Group
    DECODER_KEYS = ("text_dec", "dec_mask")  # --decoder-seq-length long; the others --seq-length

    @staticmethod
    def build_datasets(args: argparse.Namespace, data: LanguageData, sizes: SplitSizes) -> tuple:
        return build_t5_datasets(args, data.tokenizer, data.corpus, sizes)

    @staticmethod
    def inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"input_ids": batch["text_enc"], "attention_mask": batch["enc_mask"],
                "decoder_input_ids": batch["text_dec"], "decoder_attention_mask": batch["dec_mask"],
                "use_cache": False}  # fmt: skip

    def criterion(self, out: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm = masked_mean(token_losses(out.logits, batch["labels"], self.vocab_size, self.tp_group), batch["loss_mask"])
        return lm, {"lm loss": lm.detach()}


@dataclass
class VisionTask(_ModelLoss):
    """Image classification (``pretrain_vision.py``): cross-entropy on the logits, and top-1
    accuracy, named ``loss`` and ``accuracy`` as Megatron's vision classification logs them."""

    @staticmethod
    def build_datasets(args: argparse.Namespace, data: None, sizes: SplitSizes) -> tuple:
        """The generated image set (``data/images.py``), each split sized as the run needs it (no
        language data to read)."""
        shape = (args.img_h, args.img_w, args.num_channels, args.num_classes)
        return tuple(PatternImages(n, split, args.seed, *shape) if n else None
                     for n, split in zip(sizes.as_list(), SPLITS, strict=True))  # fmt: skip

    @staticmethod
    def inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"pixel_values": batch["pixels"]}

    def criterion(self, out: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = out.logits.float()
        loss = F.cross_entropy(logits, batch["label"])
        accuracy = (logits.argmax(-1) == batch["label"]).float().mean()
        return loss, {"loss": loss.detach(), "accuracy": accuracy}
