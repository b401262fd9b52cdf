"""Kernels, against the code they replace: drop-in GeLU and RMS norm, compiled layers, the chunked
cross-entropy."""

import argparse
import copy
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch._inductor.utils import run_and_get_code
from transformers.activations import FastGELUActivation, NewGELUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import megatron_slapo as ms
from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels import cross_entropy
from megatron_slapo.kernels.compiled import compiler_problem
from megatron_slapo.kernels.cross_entropy import chunked_cross_entropy
from megatron_slapo.kernels.drop_in import GeLU, RMSNorm
from megatron_slapo.kernels.vocab import VocabParallelLMLoss
from megatron_slapo.parallel.random import seed
from megatron_slapo.plans.kernel_swap import swap_in_kernels
from schedules import llama_tp
from tests.utils import require_compiler, tiny_gpt2_config, tiny_llama_config


def _value_and_grad(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` and the gradient of a weighted sum of it, in fp32 (fp64 for an fp64 ``x``)."""
    out = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    (y * torch.linspace(-1, 1, y.size(-1), dtype=y.dtype)).sum().backward()
    return y.detach().to(out), x.grad.to(out)


@pytest.mark.parametrize("formula", [NewGELUActivation, FastGELUActivation])
def test_gelu_kernel_equals_hf_formula(formula):
    """The kernel against HF's formula evaluated in fp64: fp32 output and input gradient to 1e-6,
    bf16 to bf16's precision. (fp64, because torch 2.13's fp32 formula on this CPU differs from
    run to run by up to 1e-4 when its input requires grad: the reference must not move.)"""
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0)) * 3
    ref_y, ref_g = _value_and_grad(formula(), x.double())
    y, g = _value_and_grad(GeLU("tanh"), x)
    torch.testing.assert_close(y, ref_y.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, ref_g.float(), rtol=1e-6, atol=1e-6)
    y16, g16 = _value_and_grad(GeLU("tanh"), x.bfloat16())
    torch.testing.assert_close(y16, ref_y.float(), rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(g16, ref_g.float(), rtol=2**-6, atol=2**-6)


def test_swap_in_kernels_replaces_every_formula_and_keeps_the_model():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    reference = copy.deepcopy(model)
    sch = ms.create_schedule(model)
    paths = swap_in_kernels(sch)
    assert paths == ["transformer.h.0.mlp.act", "transformer.h.1.mlp.act"]
    built = ms.build(sch, init_weights=False)
    assert all(isinstance(layer.mlp.act, GeLU) for layer in built.transformer.h)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(built(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_rms_norm_kernel_equals_llamas_and_is_swapped_in():
    """fp32 and bf16 inputs: output, input and weight gradients as LlamaRMSNorm's (to 1e-6; bf16
    to its precision); in a Llama every norm is swapped, and the logits are unchanged."""
    torch.manual_seed(0)
    reference = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    kernel = RMSNorm(64, eps=1e-5)
    kernel.weight = torch.nn.Parameter(reference.weight.detach().clone())
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0)) * 3
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
        y, g = _value_and_grad(lambda t: kernel(t), x.to(dtype))
        ref_y, ref_g = _value_and_grad(lambda t: reference(t), x.to(dtype))
        torch.testing.assert_close(y, ref_y, rtol=tol, atol=tol)
        torch.testing.assert_close(g, ref_g, rtol=tol, atol=tol)
    torch.testing.assert_close(kernel.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    before = copy.deepcopy(model)
    sch = ms.create_schedule(model)
    swapped = swap_in_kernels(sch)
    layers = tiny_llama_config().num_hidden_layers
    assert len(swapped) == 2 * layers + 1 and swapped[-1] == "model.norm", swapped
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ms.build(sch, init_weights=False)(ids).logits, before(ids).logits, rtol=1e-5, atol=1e-5)


def test_compiled_layers_equal_eager_and_share_their_code():
    """Each GPT-2 block compiled (inductor), dropout on: outputs and every gradient as eager, to
    1e-5 (the same masks); a deep copy runs its own weights."""
    require_compiler()
    torch.manual_seed(0)
    config = tiny_gpt2_config(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    sch = ms.create_schedule(model)
    for layer in range(config.n_layer):
        sch[f"transformer.h.{layer}"].compile()
    compiled = ms.build(sch, init_weights=False)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (compiled, reference):
        torch.manual_seed(7)
        m(ids).logits.pow(2).mean().backward()
    torch.manual_seed(7)
    logits = compiled(ids).logits
    torch.manual_seed(7)
    torch.testing.assert_close(logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(compiled.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    twin = copy.deepcopy(compiled).eval()
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, compiled.eval()(ids).logits)
        twin.transformer.h[0].mlp.c_fc.weight.zero_()
        assert not torch.allclose(twin(ids).logits, compiled(ids).logits)


def test_compile_refusals():
    sch = ms.create_schedule(transformers.GPT2LMHeadModel(tiny_gpt2_config()))
    sch["transformer.h.0"].compile()
    with pytest.raises(SchedulingError, match="already applied"):
        sch["transformer.h.0"].compile()
    assert "no-such-backend" in compiler_problem("no-such-backend")


def test_the_compiler_probe_reports_only_a_machine_that_cannot_build():
    """compiler_problem answers "cannot build kernels here" for what torch raises without a working
    C++ compiler (InvalidCxxCompiler, or a CppCompileError from the toolchain), wrapped as dynamo
    wraps a backend's errors; require_compiler turns that answer into a skip. Any other error of the
    compile is raised: a compiler that broke fails the compile tests and the run, not skips them."""
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    def no_compiler(gm, example_inputs):
        raise InvalidCxxCompiler()

    def failing_toolchain(gm, example_inputs):
        raise CppCompileError(["cc", "kernel.cpp"], "fatal error: Python.h: No such file or directory")

    def broken(gm, example_inputs):
        raise ValueError("a bug in the backend")

    with pytest.raises(Exception, match="a bug in the backend"):
        compiler_problem(broken)
    assert ": InvalidCxxCompiler No working C++ compiler" in compiler_problem(no_compiler)
    assert ": CppCompileError C++ compile error" in compiler_problem(failing_toolchain)


def test_the_compiler_probe_answers_alike_under_no_grad():
    """Its first caller may be a loss's forward (no_grad): the probe's backward must still run."""
    compiler_problem.cache_clear()
    with torch.no_grad():
        under_no_grad = compiler_problem()
    compiler_problem.cache_clear()
    assert under_no_grad == compiler_problem()


def test_a_layer_without_attention_dropout_compiles_as_one_graph():
    """llama_tp forks the RNG around attention for its dropout masks. Llama has no attention
    dropout, so no fork runs, and each compiled layer stays one graph (a fork breaks it in four)."""
    require_compiler()
    seed(0)
    config = tiny_llama_config()
    sch = ms.create_schedule(transformers.LlamaForCausalLM(config))
    llama_tp.apply(sch, config, argparse.Namespace(sequence_parallel=False))
    for layer in range(config.num_hidden_layers):
        sch[f"model.layers.{layer}"].compile()
    model = ms.build(sch, init_weights=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model(torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))).logits.sum().backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_torch(monkeypatch, dtype):
    """Loss and logits gradient as ``F.cross_entropy`` on fp32 logits (fp32: to 1e-6; bf16 logits:
    the gradient to bf16's precision), over several chunks, with ignored positions."""
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 4 * 100 * 7)  # 7 of the 32 rows per chunk: 5 chunks
    logits = (torch.randn(32, 100, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    target = torch.randint(0, 100, (32,), generator=torch.Generator().manual_seed(1))
    target[3], target[5] = -100, -1  # ignored; outside the vocabulary (BERT marks unmasked tokens so)
    weights = torch.rand(32, generator=torch.Generator().manual_seed(2))
    ours, ours_grad = _loss_and_grad(lambda x: chunked_cross_entropy(x, target), logits, weights)
    ignored = target.masked_fill(target < 0, -100)
    ref, ref_grad = _loss_and_grad(lambda x: F.cross_entropy(x.float(), ignored, reduction="none"), logits, weights)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(ours_grad, ref_grad.to(dtype).float(), rtol=tol, atol=tol)
    assert ours[3] == ours[5] == 0 and not ours_grad[3].any() and not ours_grad[5].any()


def test_the_compiled_one_pass_equals_the_eager_one_with_no_fp32_chunk():
    """What a GPU runs (inductor's kernel, here on this CPU) against the eager pass: loss and
    gradient, with ignored and out-of-vocabulary targets and a one-row chunk; and the compiled code
    allocates no fp32 buffer of the chunk's size (its point: 512 MiB chunks on a GPU)."""
    require_compiler()
    compiled = torch.compile(cross_entropy._loss_and_grad_fusable)
    logits = (torch.randn(9, 100, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    target = torch.randint(0, 100, (9,), generator=torch.Generator().manual_seed(1))
    target[2], target[5], target[7] = -100, -1, 105
    inside = (target >= 0) & (target < 100)
    local = target.masked_fill(~inside, 0)
    for rows in (slice(0, 8), slice(8, 9)):  # a full chunk, then the last one of one row
        (loss, grad), code = run_and_get_code(compiled, logits[rows], local[rows], inside[rows])
        eager_loss, eager_grad = cross_entropy._loss_and_grad(logits[rows], local[rows], inside[rows])
        torch.testing.assert_close(loss[inside[rows]], eager_loss[inside[rows]], rtol=1e-5, atol=1e-5)
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad.float(), eager_grad.float(), rtol=1e-6, atol=1e-6)
        size = rows.stop - rows.start
        assert not re.search(rf"empty_strided\w*\(\({size}, 100\), \(100, 1\), torch\.float32\)", "".join(code))


def _loss_and_grad(fn, logits: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_()
    loss = fn(x)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad.float()


def test_the_lm_loss_averages_over_the_labels_it_scores():
    """HF's ``labels=`` path on vocabulary-parallel heads: BERT's -1 (unmasked) labels are neither
    scored nor counted, as -100 ones."""
    logits = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    labels[0, :3] = -1
    loss = VocabParallelLMLoss(None, causal=False)(logits, labels)
    expected = F.cross_entropy(logits.reshape(-1, 50), labels.masked_fill(labels < 0, -100).reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_replace_after_compile_is_refused():
    config = tiny_gpt2_config()
    sch = ms.create_schedule(transformers.GPT2LMHeadModel(config))
    sch["transformer.h.0"].compile()
    with pytest.raises(SchedulingError, match="already has compile; apply replace"):
        sch["transformer.h.0"].replace(transformers.models.gpt2.modeling_gpt2.GPT2Block(config))
