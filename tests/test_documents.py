"""--reset-position-ids / --reset-attention-mask / --eod-mask-loss: the dataset's masks and what the model sees."""

import numpy
import pytest
import torch
import transformers
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.data.datasets import Corpus, SplitSizes, build_gpt_datasets
from megatron_slapo.data.tokenizers import build_tokenizer
from megatron_slapo.errors import ConfigError
from megatron_slapo.training.model import build_config
from megatron_slapo.training.tasks import GPTTask

VOCAB = 100  # NullTokenizer: ids 0..99, end-of-document 100
EOD = VOCAB
SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 short documents (3-9 tokens + EOD), so every 16-token sample spans several."""
    root = tmp_path_factory.mktemp("documents")
    prefix = str(root / "docs")
    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(60):
        doc = rng.integers(0, VOCAB, size=int(rng.integers(3, 10))).tolist() + [EOD]
        builder.add_item(torch.tensor(doc, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix, str(root / "cache")


def samples(corpus, *flags):
    prefix, cache = corpus
    args = parse_args("gpt", ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                              "--seq-length", str(SEQ), "--num-layers", "2", "--hidden-size", "64",
                              "--num-attention-heads", "4", "--micro-batch-size", "2", "--train-iters", "4",
                              "--lr", "1e-3", "--split", "100,0,0", "--eval-iters", "0", "--data-cache-path", cache,
                              *flags])  # fmt: skip
    validate_args(args, 1)
    tokenizer = build_tokenizer("NullTokenizer", None, None, None, VOCAB)
    corpus = Corpus(args.data_path, SEQ, tokenizer.vocab_size, "tokenizer (NullTokenizer)")
    train, _, _ = build_gpt_datasets(args, tokenizer, corpus, SplitSizes(8, 0, 0))
    return [train[i] for i in range(8)]


def test_the_dataset_and_the_model_inputs_follow_the_flags(corpus):
    plain = samples(corpus)
    assert all(torch.equal(s["position_ids"], torch.arange(SEQ)) and s["loss_mask"].all() for s in plain)
    eods = sum(int((s["tokens"] == EOD).sum()) for s in plain)
    assert eods >= 8  # the samples do span documents
    assert set(GPTTask(VOCAB + 1, None).inputs({"tokens": plain[0]["tokens"][None]})) == {"input_ids", "use_cache"}

    for s in samples(corpus, "--eod-mask-loss"):
        assert torch.equal(s["loss_mask"], (s["tokens"] != EOD).float())

    task = GPTTask(VOCAB + 1, None, True, True, EOD)
    for s in samples(corpus, "--reset-position-ids", "--reset-attention-mask"):
        doc = torch.cat([torch.zeros(1, dtype=torch.long), (s["tokens"] == EOD).long().cumsum(0)[:-1]])
        starts = [next(j for j in range(SEQ) if doc[j] == doc[i]) for i in range(SEQ)]
        assert s["position_ids"].tolist() == [i - starts[i] for i in range(SEQ)]
        inputs = task.inputs({k: v[None] for k, v in s.items()})
        assert torch.equal(inputs["position_ids"][0], s["position_ids"])
        # Megatron's per-document mask (megatron-core's own function; True where masked), inverted for sdpa.
        megatron, _, _ = _get_ltor_masks_and_position_ids(s["tokens"], EOD, False, True, False, True)
        assert inputs["attention_mask"].shape == (1, 1, SEQ, SEQ)
        assert torch.equal(inputs["attention_mask"][0], ~megatron)


def _packed_batch(first: list[int], second: list[int], reset_positions: bool) -> dict:
    """One sample, two documents, as GPTDataset builds it (its own position function)."""
    tokens = torch.tensor(first + [EOD] + second)
    _, loss_mask, positions = _get_ltor_masks_and_position_ids(tokens, EOD, reset_positions, False, False, False)
    return {"tokens": tokens[None], "position_ids": positions[None], "loss_mask": loss_mask[None]}


def _model(model_type: str, attention: str) -> torch.nn.Module:
    args = parse_args("gpt", ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                              "--model-type", model_type, "--num-layers", "2", "--hidden-size", "64",
                              "--num-attention-heads", "4", "--seq-length", str(SEQ), "--micro-batch-size", "1",
                              "--train-iters", "1", "--lr", "1e-3"])  # fmt: skip
    validate_args(args, 1)
    config = build_config(args, build_tokenizer("NullTokenizer", None, None, None, VOCAB))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


@pytest.mark.parametrize("model_type, attention", [("gpt2", "sdpa"), ("gpt2", "eager"), ("gpt_neo", "eager"),
                                                   ("opt", "sdpa"), ("llama", "sdpa"), ("llama", "eager")])  # fmt: skip
@torch.no_grad()
def test_the_model_sees_documents_apart(model_type, attention):
    model = _model(model_type, attention)
    first, second = [5, 17, 3, 44, 9], [8, 21, 2, 60, 33, 7, 12, 1, 90, 4]
    n = len(first) + 1  # where the second document starts

    def logits(reset_positions: bool, reset_mask: bool) -> torch.Tensor:
        task = GPTTask(VOCAB + 1, None, reset_positions, reset_mask, EOD, model.config._attn_implementation)
        return model(**task.inputs(_packed_batch(first, second, reset_positions))).logits[0]

    alone = model(input_ids=torch.tensor([second]), use_cache=False).logits[0]
    positions = torch.arange(n, SEQ)[None]
    shifted = model(input_ids=torch.tensor([second]), position_ids=positions, use_cache=False).logits[0]
    both, mask_only = logits(True, True), logits(False, True)
    positions_only, neither = logits(True, False), logits(False, False)
    # Both flags: the second document is computed exactly as if it stood alone.
    assert (both[n:] - alone).abs().max() < 1e-5
    # The mask alone: the same document, at the positions it has in the sample.
    assert (mask_only[n:] - shifted).abs().max() < 1e-5
    # Neither (the default), or positions alone (Megatron: attention still crosses documents; HF, given
    # restarting positions and no mask, would infer packed documents): the second document sees the first.
    assert (neither[n:] - shifted).abs().max() > 1e-3
    assert (positions_only[n:] - alone).abs().max() > 1e-3
    assert (positions_only[:n] - neither[:n]).abs().max() < 1e-5  # the first document: no difference


def test_what_cannot_give_documents_is_one_error():
    batch = _packed_batch([1, 2], [3, 4], True)
    with pytest.raises(ConfigError, match="need the model's attention to take a 4D mask"):
        GPTTask(VOCAB + 1, None, True, True, EOD, "flash_attention_2").inputs(batch)
    with pytest.raises(ConfigError, match="need a tokenizer with an end-of-document token"):
        GPTTask(VOCAB + 1, None, False, True, None)
