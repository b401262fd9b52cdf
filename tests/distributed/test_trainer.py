"""pretrain_gpt.py / pretrain_bert.py end to end on 2 ranks (in-process ``pretrain`` calls, see runs.py)."""

import json
import math
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import transformers

import megatron_slapo as ms
from megatron_slapo.checkpoints import checkpointing
from megatron_slapo.data import embedded
from megatron_slapo.parallel.collectives import gather_tensor
from megatron_slapo.training.loop import pretrain
from schedules import gpt_tp
from tests.distributed.conftest import use_layout
from tests.distributed.runs import TINY, TP2, last_rank_value
from tests.utils import (
    max_diff,
    tb_scalars,
    tb_tags,
    tiny_albert,
    tiny_bert_config,
    tiny_llama_config,
    tiny_roberta,
    tiny_t5,
    tiny_wideresnet,
)
from tools import convert_checkpoint, preprocess_data, train_tokenizer


def test_embedded_default_run_prints_the_log_line_and_writes_tensorboard(shared_tmp, cache, capsys):
    """Megatron's log line and TensorBoard tags, with torchtitan's throughput, ``tflops`` and, against
    a given ``--peak-tflops``, ``mfu(%)`` (a CPU has no known peak)."""
    tb, peak = os.path.join(shared_tmp, "tb-embedded"), 0.5
    state = pretrain("gpt", [*TP2, "--train-iters", "6", "--log-interval", "3", "--eval-interval", "3",
                             "--tensorboard-dir", tb, "--data-cache-path", cache, "--peak-tflops", str(peak)])  # fmt: skip
    assert state.iteration == 6 and state.consumed_train_samples == 6 * 16
    out = capsys.readouterr().out
    line = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        6/       6 \| consumed samples:           96 \| "
    line += r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| "
    line += r"learning rate: [\d.]+E[-+]\d\d \| global batch size:    16 \| lm loss: [\d.]+E\+00 \| loss scale: 1.0 \| "
    line += r"grad norm: [\d.]+ \| number of skipped iterations:   0 \| number of nan iterations:   0 \|"
    line += r".* \| MFU: [\d.]+% \|"
    found = last_rank_value(lambda: bool(re.search(line, out)))
    tags = last_rank_value(lambda: tb_tags(tb))
    losses = last_rank_value(lambda: tb_scalars(tb, "lm loss"))
    tflops = last_rank_value(lambda: tb_scalars(tb, "tflops"))
    mfu = last_rank_value(lambda: tb_scalars(tb, "mfu(%)"))
    assert found, "Megatron log line missing"
    assert losses[6] < losses[1] - 0.5, losses
    for tag in ("lm loss", "throughput(tps)", "lm loss validation", "learning-rate", "grad-norm", "iteration-time"):
        assert tag in tags, tag
    assert sorted(tflops) == sorted(mfu) == list(range(1, 7)) and all(tflops[i] > 0 for i in tflops), (tflops, mfu)
    assert all(abs(mfu[i] - 100 * tflops[i] / peak) <= 1e-4 * mfu[i] for i in mfu), (tflops, mfu)


RESUME_CASES = {
    "gpt-tp2-fp32": ("gpt", [*TP2]),
    "gpt-tp2-bf16": ("gpt", [*TP2, "--bf16"]),  # bf16 weights, fp32 main weights in the optimizer
    "gpt-pp2-distopt-bf16": ("gpt", ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16"]),
    "bert-dp2-fp16": ("bert", ["--initial-loss-scale", "4096", "--fp16"]),  # scaler state, per-DP-rank RNG
    "bert-ddp-fp16": ("bert", ["--engine", "ddp", "--initial-loss-scale", "4096", "--fp16"]),
    "gpt-pp2": ("gpt", ["--pipeline-model-parallel-size", "2"]),  # one file per pipeline stage
    "gpt-dp2-distopt": ("gpt", ["--use-distributed-optimizer"]),  # distrib_optim.pt, gathered on DP rank 0
    "gpt-zero3": ("gpt", ["--engine", "deepspeed", "--zero-stage", "3"]),  # ZeRO partitions, via DeepSpeed's files
    "gpt-fsdp-tp2": ("gpt", ["--engine", "fsdp", *TP2]),  # optimizer shards of DTensors
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_continues_with_the_same_losses(shared_tmp, cache, case):
    task, extra = RESUME_CASES[case]
    run = [*extra, *TINY, "--train-iters", "8", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1",
           "--data-cache-path", cache]  # fmt: skip
    tb, ck = os.path.join(shared_tmp, f"tb-resume-{case}"), os.path.join(shared_tmp, f"ck-resume-{case}")
    pretrain(task, [*run, "--tensorboard-dir", f"{tb}/full"])
    pretrain(task, [*run, "--tensorboard-dir", f"{tb}/a", "--save", ck, "--save-interval", "4", "--exit-interval", "4"])
    assert checkpointing.latest_iteration(ck) == 4
    if dist.get_rank() == 0:  # a run killed while saving iteration 8 leaves a partial directory behind
        os.makedirs(checkpointing.iteration_dir(ck, 8) + ".tmp/mp_rank_00")
        open(checkpointing.iteration_dir(ck, 8) + ".tmp/mp_rank_00/model_optim_rng.pt.partial", "wb").write(b"\0" * 99)
    dist.barrier()
    # Saving at iteration 6 and training on checks that a save leaves the engine's state as it was.
    pretrain(task, [*run, "--tensorboard-dir", f"{tb}/b", "--save", ck, "--load", ck, "--save-interval", "2"])
    full = last_rank_value(lambda: tb_scalars(f"{tb}/full", "lm loss"))
    parts = last_rank_value(lambda: {**tb_scalars(f"{tb}/a", "lm loss"), **tb_scalars(f"{tb}/b", "lm loss")})
    assert sorted(parts) == sorted(full) == list(range(1, 9))
    assert parts == full  # bit for bit: weights, optimizer, RNG and data position all restored
    assert full[8] != full[4]  # the model did train in the second half
    assert os.path.isdir(checkpointing.iteration_dir(ck, 6))
    assert checkpointing.latest_iteration(ck) == 8 and not os.path.exists(checkpointing.iteration_dir(ck, 8) + ".tmp")
    finetune = pretrain(task, [*run, "--load", ck, "--finetune", "--train-iters", "2", "--eval-iters", "0"])
    assert finetune.iteration == 2 and finetune.consumed_train_samples == 16  # weights only: a fresh run


def test_a_pipeline_run_loads_the_weights_of_a_checkpoint_saved_without_pipeline(shared_tmp, cache, rank, capsys):
    """The legacy format (torch_dist loads at any layout, optimizer included: tests/test_reshard.py)."""
    run = [*TINY, "--num-layers", "4", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--data-cache-path", cache, "--ckpt-format", "torch"]  # fmt: skip
    ck, tb = os.path.join(shared_tmp, "ck-pp1"), os.path.join(shared_tmp, "tb-pp-from-pp1")
    pretrain("gpt", [*run, "--train-iters", "2", "--save", ck])
    with pytest.raises(SystemExit):  # its optimizer state holds no stage's parameters in Megatron's order
        pretrain("gpt", [*run, "--train-iters", "3", "--load", ck, "--pipeline-model-parallel-size", "2"])
    err = capsys.readouterr().err
    assert rank != 0 or "saved without pipeline parallelism" in err and "--no-load-optim" in err, err
    state = pretrain("gpt", [*run, "--train-iters", "3", "--load", ck, "--no-load-optim", "--pipeline-model-parallel-size",
                             "2", "--eval-iters", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert state.iteration == 3  # resumed at 2; the stages keep their own RNG streams (one stage's were saved)
    assert rank != 0 or "RNG states not restored" in out, out
    finetune = [*run, "--train-iters", "1", "--load", ck, "--finetune"]
    pretrain("gpt", [*finetune, "--tensorboard-dir", f"{tb}/pp1"])
    pretrain("gpt", [*finetune, "--pipeline-model-parallel-size", "2", "--tensorboard-dir", f"{tb}/pp2"])
    pp1 = last_rank_value(lambda: tb_scalars(f"{tb}/pp1", "lm loss"))
    pp2 = last_rank_value(lambda: tb_scalars(f"{tb}/pp2", "lm loss"))
    assert abs(pp1[1] - pp2[1]) < 1e-5, (pp1, pp2)  # the same weights on the same first batch


def test_tensor_and_data_parallel_layouts_train_alike(shared_tmp, cache):
    run = [*TINY, "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
           "--attention-dropout", "0", "--data-cache-path", cache]  # fmt: skip
    tb = os.path.join(shared_tmp, "tb-layouts")
    pretrain("gpt", [*run, *TP2, "--tensorboard-dir", f"{tb}/tp"])
    pretrain("gpt", [*run, "--schedule", "default", "--tensorboard-dir", f"{tb}/dp"])  # DDP over 2 ranks
    tp = last_rank_value(lambda: tb_scalars(f"{tb}/tp", "lm loss"))
    dp = last_rank_value(lambda: tb_scalars(f"{tb}/dp", "lm loss"))
    assert max(abs(tp[i] - dp[i]) for i in tp) < 1e-5, (tp, dp)  # only the reduction order differs
    assert tp[4] < tp[1]


@pytest.fixture(scope="module")
def preprocessed(shared_tmp):
    root = os.path.join(shared_tmp, "jsonl")
    if dist.get_rank() == 0:
        os.makedirs(root)
        with open(f"{root}/docs.jsonl", "w") as f:
            for doc in embedded.documents()[:150]:
                f.write(json.dumps({"text": doc}) + "\n")
        train_tokenizer.main(
            ["--input", f"{root}/docs.jsonl", "--type", "bpe", "--vocab-size", "1000", "--output-dir", root]
        )
        train_tokenizer.main(["--input", f"{root}/docs.jsonl", "--type", "wordpiece", "--vocab-size", "1000",
                              "--output-dir", root])  # fmt: skip
        common = ["--input", f"{root}/docs.jsonl", "--no-progress", "--workers", "2"]
        preprocess_data.main(
            [
                *common,
                "--output-prefix",
                f"{root}/gpt",
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                f"{root}/vocab.json",
                "--merge-file",
                f"{root}/merges.txt",
                "--append-eod",
            ]
        )
        preprocess_data.main([*common, "--output-prefix", f"{root}/bert", "--tokenizer-type", "BertWordPieceLowerCase",
                              "--vocab-file", f"{root}/vocab.txt", "--split-sentences"])  # fmt: skip
    dist.barrier()
    return root


def test_train_gpt_and_bert_on_preprocessed_jsonl(preprocessed, shared_tmp):
    root, tb = preprocessed, os.path.join(shared_tmp, "tb-jsonl")
    common = [*TINY, "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--split", "98,2,0"]
    blend = ["0.7", f"{root}/gpt_text_document", "0.3", f"{root}/gpt_text_document"]  # Megatron's weighted blend
    pretrain("gpt", [*common, *TP2, "--train-iters", "6", "--data-path", *blend,
                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{root}/vocab.json",
                     "--merge-file", f"{root}/merges.txt", "--tensorboard-dir", f"{tb}/gpt"])  # fmt: skip
    pretrain("bert", [*common, "--schedule", "bert_tp", "--tensor-model-parallel-size", "2", "--train-iters", "30",
                      "--data-path", f"{root}/bert_text_sentence", "--tokenizer-type", "BertWordPieceLowerCase",
                      "--vocab-file", f"{root}/vocab.txt", "--tensorboard-dir", f"{tb}/bert"])  # fmt: skip
    gpt = last_rank_value(lambda: tb_scalars(f"{tb}/gpt", "lm loss"))
    mlm = last_rank_value(lambda: tb_scalars(f"{tb}/bert", "lm loss"))
    sop = last_rank_value(lambda: tb_scalars(f"{tb}/bert", "sop loss"))
    assert len(gpt) == 6 and gpt[6] < gpt[1]
    first, last = sum(mlm[i] for i in range(1, 6)) / 5, sum(mlm[i] for i in range(26, 31)) / 5
    assert last < first - 0.25, (first, last)  # the masked-LM loss falls (from ln 1000 = 6.9)
    assert len(sop) == 30


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_hf_export_of_a_tp2_checkpoint_reproduces_the_logits(ckpt_format, shared_tmp, cache, rank):
    ck, hf = os.path.join(shared_tmp, f"ck-export-{ckpt_format}"), os.path.join(shared_tmp, f"hf-export-{ckpt_format}")
    # 4096 tokens padded to a multiple of 100 x 2: 104 dummy rows that export must drop.
    pretrain("gpt", [*TP2, *TINY, "--train-iters", "3", "--eval-iters", "0", "--make-vocab-size-divisible-by", "100",
                     "--save", ck, "--data-cache-path", cache, "--ckpt-format", ckpt_format])  # fmt: skip
    if rank == 0:
        convert_checkpoint.main(["to-hf", "--load", ck, "--save-hf", hf])  # torch_dist: one process, no group used
    dist.barrier()
    shards, round_trip = ck, True
    if ckpt_format == "torch_dist":  # the run's TP shards, each rank reading its own out of the global tensors
        shards, again = ck + "-torch", ck + "-again"
        convert_checkpoint.main(["to-torch", "--load", ck, "--save", shards, "--schedule", "gpt_tp",
                                 "--tensor-model-parallel-size", "2"])  # fmt: skip
        convert_checkpoint.main(["to-torch-dist", "--load", shards, "--save", again])  # and back to the same tensors
        if rank == 0:
            convert_checkpoint.main(["to-hf", "--load", again, "--save-hf", again + "-hf"])
            a = transformers.GPT2LMHeadModel.from_pretrained(hf).state_dict()
            b = transformers.GPT2LMHeadModel.from_pretrained(again + "-hf").state_dict()
            round_trip = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        dist.barrier()

    use_layout(2)
    state = checkpointing.read(
        os.path.join(checkpointing.iteration_dir(shards, 3), f"mp_rank_{rank:02d}", "model_optim_rng.pt")
    )
    config = transformers.GPT2Config.from_dict(json.loads(state["slapo"]["hf_config"]))
    assert config.vocab_size == 4200 and state["slapo"]["vocab"]["true"] == 4096
    with torch.device("meta"):
        trained = transformers.GPT2LMHeadModel(config)
    sch = ms.create_schedule(trained)
    gpt_tp.apply(sch, config)
    ms.build(sch, init_weights=False)
    trained.load_state_dict(state["model"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    assert exported.config.vocab_size == 4096 and exported.lm_head.weight is exported.transformer.wte.weight
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = gather_tensor(trained.eval()(ids).logits, -1, sch.group)[..., :4096]
        assert max_diff(exported(ids).logits, logits) < 1e-5
    assert round_trip


def _trained_statistics(model):
    """``model`` after one training-mode forward: BatchNorm running statistics that are not the
    initial zeros and ones, so that a misplaced shard of them shows in a round trip."""
    with torch.no_grad():
        model.train()(torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(0)))
    return model


HF_MODELS = {  # case -> (schedule, a model to convert)
    "gpt_tp": ("gpt_tp", lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=1000, n_positions=32, n_embd=32, n_layer=2, n_head=4))),
    "llama_tp": ("llama_tp", lambda: transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=1000))),
    "auto-qwen3": ("auto", lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64))),
    "auto-mixtral": ("auto", lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(  # 3-D expert weights
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, max_position_embeddings=64))),
    "bert_tp": ("bert_tp", lambda: transformers.BertForPreTraining(tiny_bert_config())),
    "bert_tp-roberta": ("bert_tp", tiny_roberta),
    "bert_tp-albert": ("bert_tp", tiny_albert),
    "t5_tp": ("t5_tp", lambda: tiny_t5(gated=True)),  # untied head, wi_0 | wi_1
    "wideresnet_tp": ("wideresnet_tp", lambda: _trained_statistics(tiny_wideresnet())),  # BatchNorm buffers split too
}  # fmt: skip


@pytest.mark.parametrize("case", HF_MODELS)
def test_hf_to_tp2_checkpoint_and_back(case, shared_tmp, rank):
    schedule, make = HF_MODELS[case]
    original_dir, ck, back = (os.path.join(shared_tmp, f"{n}-{case}") for n in ("hf-orig", "ck-from-hf", "hf-back"))
    if rank == 0:
        torch.manual_seed(0)
        make().save_pretrained(original_dir)
    dist.barrier()
    convert_checkpoint.main(["from-hf", "--load-hf", original_dir, "--save", ck, "--schedule", schedule,
                             "--tensor-model-parallel-size", "2", "--ckpt-format", "torch"])  # fmt: skip
    if rank == 0:
        convert_checkpoint.main(["to-hf", "--load", ck, "--save-hf", back])
    dist.barrier()
    cls = type(make())
    a, b = cls.from_pretrained(original_dir).state_dict(), cls.from_pretrained(back).state_dict()
    assert a.keys() == b.keys() and max(max_diff(a[k], b[k]) for k in a) < 1e-20
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ck)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "nope"], r"unknown schedule 'nope'; available: default, gpt_tp"),
        (["--global-batch-size", "5", "--micro-batch-size", "2"], r"global batch size \(5\) is not divisible"),
        ([*TP2, "--num-attention-heads", "3", "--hidden-size", "48"], r"does not divide the 3 attention heads"),
        (
            [
                "--data-path",
                "/nonexistent/corpus_text_document",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "99",
                *TINY,
                *("--train-iters", "2", "--lr", "1e-3"),
            ],
            r"data prefix '/nonexistent/corpus_text_document': .*does not exist",
        ),
        (["CORRUPT"], r"is not a Megatron index"),
    ],
    ids=["schedule", "global-batch", "heads", "missing-data", "corrupt-idx"],
)
def test_bad_input_is_one_error_line_before_training(argv, message, shared_tmp, cache, rank, capsys):
    if argv == ["CORRUPT"]:
        data = embedded.prepare("gpt", cache)
        prefix = os.path.join(shared_tmp, "corrupt_text_document")
        if rank == 0:
            shutil.copy(data.prefix + ".bin", prefix + ".bin")
            with open(data.prefix + ".idx", "rb") as f:
                raw = bytearray(f.read())
            raw[:7] = b"GARBAGE"
            with open(prefix + ".idx", "wb") as f:
                f.write(raw)
        dist.barrier()
        argv = ["--data-path", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data.vocab_file,
                "--merge-file", data.merge_file, "--seq-length", "32", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        pretrain("gpt", [*argv, "--data-cache-path", cache])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    if rank == 0:
        assert len(err) == 1 and err[0].startswith("pretrain_gpt.py: error: ") and re.search(message, err[0]), err
    else:
        assert err == []


@pytest.mark.parametrize("engine", [[], ["--engine", "deepspeed", "--zero-stage", "0"]], ids=["megatron", "zero0"])
def test_a_diverging_run_stops_with_a_clear_message(cache, rank, capsys, engine):
    """Also where the optimizer steps on NaN gradients regardless and reports no norm (ZeRO-0)."""
    argv = [*TINY, *engine, "--train-iters", "20", "--eval-iters", "0", "--init-method-std", "1e30",
            "--data-cache-path", cache]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        pretrain("gpt", [*argv, "--max-consecutive-nan-iterations", "3"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    if rank == 0:
        assert "error: stopping at iteration 3: 3 consecutive iterations had a NaN/inf loss" in err


@pytest.mark.parametrize(
    "task, argv, tags",
    [
        (
            "gpt",
            [
                "--mock-data",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "500",
                "--bf16",
                "--log-params-norm",
                "--log-timers-to-tensorboard",
                "--lr",
                "1e-3",
            ],
            ["params-norm", "train-step-time"],
        ),
        ("gpt", [*TP2, "--recompute-granularity", "full", "--log-memory-to-tensorboard"], ["mem-max-rss-bytes"]),
        ("bert", ["--model-type", "roberta", "--schedule", "bert_tp", "--tensor-model-parallel-size", "2"], []),
        ("bert", ["--model-type", "albert", "--fp16", "--bert-no-binary-head", "--initial-loss-scale", "1024"], []),
        ("gpt", ["--engine", "deepspeed", "--zero-stage", "3", "--bf16"], []),
        ("gpt", ["--engine", "fsdp", "--fp16", "--initial-loss-scale", "1024"], []),
    ],
    ids=[
        "mock-bf16-norms-timers",
        "recompute-memory",
        "roberta-tp2",
        "albert-fp16-mlm-only",
        "zero3-bf16",
        "fsdp-fp16",
    ],
)
def test_training_options_run(task, argv, tags, shared_tmp, cache):
    tb = os.path.join(shared_tmp, "tb-options", "-".join(a.strip("-") for a in argv[:4]))
    state = pretrain(task, [*TINY, *argv, "--train-iters", "3", "--eval-iters", "0", "--data-cache-path", cache,
                            "--tensorboard-dir", tb])  # fmt: skip
    assert state.iteration == 3
    losses = last_rank_value(lambda: tb_scalars(tb, "lm loss"))
    norms = last_rank_value(lambda: tb_scalars(tb, "grad-norm"))  # written for the steps taken only
    assert len(norms) == 3 and all(math.isfinite(v) for v in [*losses.values(), *norms.values()]), (losses, norms)
    written = last_rank_value(lambda: tb_tags(tb))
    for tag in ["lm loss", *tags]:
        assert tag in written, (tag, written)


def test_load_hf_starts_from_pretrained_weights(shared_tmp, cache, rank):
    hf, ck, back = (os.path.join(shared_tmp, n) for n in ("hf-pretrained", "ck-load-hf", "hf-load-hf-back"))
    if rank == 0:
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=4096, n_positions=32, n_embd=64, n_layer=2, n_head=4)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(hf)
    dist.barrier()
    # With lr 1e-30 one step moves weights by ~1e-30 (only zeros visibly): the checkpoint holds the pretrained model.
    pretrain("gpt", [*TP2, "--load-hf", hf, "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "1",
                     "--eval-iters", "0", "--lr", "1e-30", "--min-lr", "0", "--data-cache-path", cache, "--save", ck])  # fmt: skip
    if rank == 0:
        convert_checkpoint.main(["to-hf", "--load", ck, "--save-hf", back])
    dist.barrier()
    a = transformers.GPT2LMHeadModel.from_pretrained(hf).state_dict()
    b = transformers.GPT2LMHeadModel.from_pretrained(back).state_dict()
    assert a.keys() == b.keys() and max(max_diff(a[k], b[k]) for k in a) < 1e-20
    # --hf-config: the same directory's shape (not the embedded run's 4 layers of 256), freshly initialised
    shaped = os.path.join(shared_tmp, "ck-hf-config")
    pretrain("gpt", [*TP2, "--hf-config", hf, "--micro-batch-size", "4", "--train-iters", "1", "--eval-iters", "0",
                     "--data-cache-path", cache, "--save", shaped, "--ckpt-format", "torch"])  # fmt: skip
    state = checkpointing.read(os.path.join(checkpointing.iteration_dir(shaped, 1), f"mp_rank_{rank:02d}",
                                            checkpointing.FILENAME))  # fmt: skip
    config = json.loads(state["slapo"]["hf_config"])
    assert (config["n_layer"], config["n_embd"], config["n_positions"]) == (2, 64, 32), config
    assert state["model"]["transformer.wpe.weight"].shape == a["transformer.wpe.weight"].shape == (32, 64)
    assert not torch.equal(state["model"]["transformer.wpe.weight"], a["transformer.wpe.weight"])  # not loaded
