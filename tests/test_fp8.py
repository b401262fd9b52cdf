"""FP8 in one process: bad input is one line before any compute, the primitive refuses what it
cannot run, the trainer's default set says what it keeps, and checkpoints stay in the master
precision (an FP8 run resumes without FP8 and the reverse)."""

import re

import pytest
import torch
import transformers
from torch import nn

import megatron_slapo as ms
from megatron_slapo.arguments import fp8_flags
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.compat import versions
from megatron_slapo.errors import ConfigError, SchedulingError
from megatron_slapo.kernels.fp8 import Fp8Recipe
from megatron_slapo.plans import fp8
from megatron_slapo.training.loop import pretrain
from tests.test_bad_input import GPT, SIZES, TRAIN, one_error_line
from tests.utils import tb_scalars

FP8 = ["--bf16", "--fp8-format", "hybrid"]
SIXTEEN = ["--seq-length", "16", "--micro-batch-size", "2"]  # 32 tokens a micro-batch


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8-recipe", "delayed"], "--fp8-recipe delayed: Transformer Engine's delayed scaling (scales from an amax "
         "history) has no torchao training recipe; tensorwise takes each scale from the tensor itself, which delayed "
         "scaling approximates; use --fp8-recipe tensorwise or rowwise"),
        (["--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8: MX formats need Blackwell GPUs and torchao's prototype MX "
         "training; use --fp8-recipe tensorwise or rowwise"),
        (["--fp8-recipe", "blockwise"], "--fp8-recipe blockwise: block-scaled FP8 needs Transformer Engine (or "
         "torchao's prototype CUDA-only kernels); use --fp8-recipe tensorwise or rowwise"),
        (["--fp8-recipe", "columnwise"], "--fp8-recipe columnwise: unknown; the recipes are tensorwise and rowwise "
         "(Megatron's delayed, blockwise, mxfp8 need Transformer Engine)"),
        (["--fp8-format", "e5m2"], "--fp8-format e5m2: expected e4m3 or hybrid"),
        (["--fp8-param-gather"], "--fp8-param-gather all-gathers FSDP2's weight shards in FP8: it needs --engine fsdp"),
        (["--seq-length", "12"], "--fp8-format: a micro-batch's 24 tokens (per context-parallel rank) are not a "
         "multiple of 16, as the FP8 GEMM of the weight gradient needs"),
    ],
)  # fmt: skip
def test_fp8_flags_it_cannot_honour_are_one_line(flags, message, capsys):
    argv = [*GPT, *SIZES, *TRAIN, *SIXTEEN, *FP8, *flags]
    assert one_error_line("gpt", argv, capsys) == message


def test_fp8_needs_bf16_as_in_megatron(capsys):
    argv = [*GPT, *SIZES, *TRAIN, *SIXTEEN, "--fp8-format", "e4m3"]
    assert one_error_line("gpt", argv, capsys) == (
        "--fp8-format e4m3 needs --bf16 (as in Megatron: the layers around the FP8 products, and the weights FP8 is "
        "cast from, are bf16)")  # fmt: skip


@pytest.mark.parametrize("found, message", [
    (None, "--fp8-format: FP8 runs on torchao, which is not installed (pip install -r requirements.txt)"),
    ("0.17.0", "--fp8-format: torchao 0.17.0 is outside the supported range >=0.18,<0.19"),
])  # fmt: skip
def test_fp8_without_a_supported_torchao_is_one_line(found, message, monkeypatch, capsys):
    tested = {**versions.TESTED, "python": "3.11.7", "torchao": found}
    monkeypatch.setattr(versions, "installed_version", tested.get)
    monkeypatch.setattr(fp8_flags, "installed_version", tested.get)
    assert one_error_line("gpt", [*GPT, *SIZES, *TRAIN, *SIXTEEN, *FP8], capsys).startswith(message)


def test_a_gpu_without_fp8_units_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"^--fp8-format hybrid: NVIDIA A100-SXM4-80GB \(compute capability 8\.0\) "
                                          r"has no FP8 matrix units, which need compute capability 8\.9 or later"):  # fmt: skip
        fp8_flags.fp8_recipe(parse_args("gpt", [*FP8]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fp8_flags.fp8_recipe(parse_args("gpt", [*FP8])) == Fp8Recipe("tensorwise", "hybrid", emulate=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fp8_flags.fp8_recipe(parse_args("gpt", [*FP8, "--fp8-recipe", "rowwise"])).emulate


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))


def test_the_primitive_refuses_a_layer_it_cannot_run_naming_it():
    sch = ms.create_schedule(_mlp())
    recipe = Fp8Recipe(emulate=True)
    with pytest.raises(SchedulingError, match=r"^\[2\] fp8\(\) cannot apply: its weight \(8, 64\) is not a multiple "
                                              r"of 16 in both dimensions"):  # fmt: skip
        sch["2"].fp8(recipe)
    with pytest.raises(SchedulingError, match=r"^\[1\] fp8\(\) cannot apply: GELU is not an nn.Linear or HF Conv1D"):
        sch["1"].fp8(recipe)
    sch["0"].fp8(recipe)
    with pytest.raises(SchedulingError, match=r"already applied"):
        sch["0"].fp8(recipe)
    with pytest.raises(SchedulingError, match=r"apply fp8\(\) after shard\(\)"):
        sch["0"].shard("weight", axis=0)
    assert "fp8 tensorwise hybrid (emulated)" in sch.explain()


def _llama_schedule(layers: int, ffn: int) -> ms.Schedule:
    """A tiny Llama's schedule, on meta (hidden 64, 4 heads in 2 key/value groups)."""
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=ffn, vocab_size=128)  # fmt: skip
    with torch.device("meta"):
        return ms.create_schedule(transformers.LlamaForCausalLM(config))


def test_the_default_set_keeps_what_fp8_cannot_take_and_says_so():
    """Llama with an FFN of 72 (not a multiple of 16): q, k, v and o in FP8, gate, up and down kept."""
    sch = _llama_schedule(2, 72)
    note = fp8.apply(sch, Fp8Recipe(emulate=True), ["model.layers.0", "model.layers.1"])
    assert note.startswith("> FP8 (tensorwise scaling, hybrid format; emulated: no FP8 matrix units here, so the FP8 "
                           "values are multiplied in fp32): 8 Linear layers of 2 transformer layers; kept in their "
                           "precision: model.layers.*.mlp.gate_proj (its weight (72, 64) is not a multiple of 16")  # fmt: skip
    assert "model.layers.*.mlp.down_proj (its weight (64, 72)" in note and "lm_head" not in note
    assert [path for path, node in sch.named_schedules() if node.metadata.fp8] == [
        f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"]  # fmt: skip


def _dtypes(directory) -> set[torch.dtype]:
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(directory)).read_metadata()
    return {item.properties.dtype for item in meta.state_dict_metadata.values() if hasattr(item, "properties")}


def test_checkpoints_stay_in_the_master_precision_and_resume_with_or_without_fp8(tmp_path):
    """FP8 is a compute format: an FP8 run saves fp32 main weights and AdamW's moments (no float8
    tensor), a run without FP8 resumes it, and an FP8 run resumes that one; each goes on learning."""
    run = [*GPT, *SIZES, *SIXTEEN, "--lr", "1e-3", "--eval-iters", "0", "--bf16", "--log-interval", "1",
           "--save", str(tmp_path / "ck"), "--save-interval", "2"]  # fmt: skip
    steps = [(FP8, 2), ([], 4), (FP8, 6)]
    for flags, iters in steps:
        load = ["--load", str(tmp_path / "ck")] if iters > 2 else []
        pretrain("gpt", [*run, *flags, *load, "--train-iters", str(iters), "--tensorboard-dir", str(tmp_path / "tb")])
    losses = tb_scalars(str(tmp_path / "tb"), "lm loss")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(torch.isfinite(torch.tensor(list(losses.values()))))
    dtypes = _dtypes(tmp_path / "ck" / "iter_0000002")
    assert dtypes and not any(dtype.is_floating_point and dtype.itemsize == 1 for dtype in dtypes), dtypes


def test_a_layer_the_schedule_runs_in_fp8_keeps_its_recipe():
    sch = _llama_schedule(1, 128)
    sch["model.layers.0.mlp.down_proj"].fp8(Fp8Recipe("rowwise", "e4m3", emulate=True))
    note = fp8.apply(sch, Fp8Recipe(emulate=True), ["model.layers.0"])
    assert ": 7 Linear layers of 1 transformer layers" in note
    assert sch["model.layers.0.mlp.down_proj"].metadata.fp8 == "fp8 rowwise e4m3 (emulated)"
    assert sch["model.layers.0.mlp.up_proj"].metadata.fp8 == "fp8 tensorwise hybrid (emulated)"


def test_every_fp8_layer_is_gathered_in_float8_a_row_parallel_one_with_a_bias_too():
    """--fp8-param-gather wraps the weight of each FP8 layer, whichever forward holds its FP8 product
    (a row-parallel layer with a bias reduces it before adding the bias: gpt_tp's c_proj at TP 1)."""
    from megatron_slapo.kernels.fp8 import gather_weights_in_fp8

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    sch = ms.create_schedule(model)
    sch["2"].shard("weight", axis=1)  # row-parallel over one rank, with its bias: reduce, then the bias
    for path in ("0", "2"):
        sch[path].fp8(Fp8Recipe(emulate=True))
    model = ms.build(sch)
    assert gather_weights_in_fp8(model) == 2
    assert {type(model[i].weight.data).__name__ for i in (0, 2)} == {"WeightWithDynamicFloat8CastTensor"}


def test_t5s_decoder_tokens_are_checked_too(capsys):
    argv = [*GPT, *SIZES, *TRAIN, *SIXTEEN, *FP8, "--decoder-seq-length", "9"]
    assert one_error_line("t5", argv, capsys) == (
        "--fp8-format: a micro-batch's 18 decoder tokens (per context-parallel rank) are not a multiple of 16, as "
        "the FP8 GEMM of the weight gradient needs")  # fmt: skip


def test_albert_runs_its_shared_layer_in_fp8(tmp_path, capsys):
    """ALBERT runs one layer at every depth: FP8 takes that layer's Linear layers (q, k, v, its
    attention's output, the FFN's two)."""
    argv = [*SIZES, *TRAIN, *SIXTEEN, *FP8, "--model-type", "albert", "--data-cache-path", str(tmp_path),
            "--tensorboard-dir", str(tmp_path / "tb")]  # fmt: skip
    pretrain("bert", argv)
    assert re.search(r"^> FP8 \(tensorwise scaling.*\): 6 Linear layers of 1 transformer layers", capsys.readouterr().out,
                     re.M)  # fmt: skip
    assert sorted(tb_scalars(str(tmp_path / "tb"), "lm loss")) == [1, 2]
