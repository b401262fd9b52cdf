"""On a CUDA GPU: the kernels against the code they replace, and the one-device recipes' training
against HF's own model. Skipped without a GPU (CI has none); ``tools/gpu_check.sh`` runs this file
on a lent one and records what it prints under ``docs/benchmarks/``.

Errors are relative norms ``|out - ref| / |ref|``: fp32 (TF32 off) must land under 1e-5, bf16
under 1e-2. Reference and candidate share the weights and the dropout masks.
"""

import argparse
import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.activations import NewGELUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import megatron_slapo as ms
from megatron_slapo.kernels import attention
from megatron_slapo.kernels.cross_entropy import chunked_cross_entropy
from megatron_slapo.kernels.drop_in import GeLU, RMSNorm
from megatron_slapo.kernels.vocab import vocab_parallel_cross_entropy
from megatron_slapo.parallel.random import seed
from schedules import get_schedule
from tests.utils import require_compiler, tiny_bert_config, tiny_gpt2_config, tiny_llama_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _full_fp32():
    """fp32 is fp32 here: no TF32 in matrix products or convolutions."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(CUDA)


PADDED = torch.tensor([[1] * 64, [1] * 40 + [0] * 24])  # a non-causal mask with holes
MODELS = {  # causal; causal with grouped-query attention; padded and bidirectional
    "gpt2": (transformers.GPT2LMHeadModel, tiny_gpt2_config(n_embd=128, n_positions=64), None),
    "llama-gqa": (transformers.LlamaForCausalLM, tiny_llama_config(hidden_size=128, num_attention_heads=4), None),
    "bert-padded": (transformers.BertForPreTraining, tiny_bert_config(hidden_size=128), PADDED),
}


def _attention_run(name: str, implementation: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, set]:
    """Logits, the concatenated parameter gradients, and the CUDA kernels' names that ran."""
    cls, config, mask = MODELS[name]
    torch.manual_seed(0)
    model = cls(config).to(CUDA, dtype).eval()
    model.set_attn_implementation(implementation)
    ids = _ids(2, 64, 128)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = model(ids, attention_mask=None if mask is None else mask.to(CUDA))
        logits = out.logits if hasattr(out, "logits") else out.prediction_logits
        (logits.float() * torch.linspace(-1, 1, logits.size(-1), device=CUDA)).sum().backward()
        torch.cuda.synchronize()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return logits.float(), grads, {e.name for e in prof.events() if e.device_type.name == "CUDA"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["flash", "fused"])
@pytest.mark.parametrize("name", MODELS)
def test_attention_backends_equal_eager_attention(name, backend, dtype):
    """--attention-backend flash/fused run only their kernels (or raise) and equal eager attention:
    logits and every gradient. A case the kernel does not take is reported as a skip, with why."""
    problem = attention.unavailable(backend, CUDA, 0.0, dtype)
    if problem:
        pytest.skip(problem)
    try:
        logits, grads, kernels = _attention_run(name, attention.implementation(backend), dtype)
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        pytest.skip(f"{backend} has no kernel for {name} in {dtype}: {str(e).splitlines()[0][:160]}")
    ref_logits, ref_grads, _ = _attention_run(name, "eager", dtype)
    sdpa = sorted(k for k in kernels if any(w in k.lower() for w in ("flash", "fmha", "cudnn", "attention", "sdpa")))
    print(f"\n{name} {backend} {dtype}: logits {rel_error(logits, ref_logits):.2e}, grads "
          f"{rel_error(grads, ref_grads):.2e}; kernels {[k[:70] for k in sdpa]}")  # fmt: skip
    assert rel_error(logits, ref_logits) < TOLERANCE[dtype]
    assert rel_error(grads, ref_grads) < TOLERANCE[dtype]
    assert sdpa, "no attention kernel ran"


def test_drop_in_kernels_equal_hf_formulas():
    """GeLU (tanh) and F.rms_norm against HF's formulas, fp32 and bf16, forward and input gradient."""
    x = torch.randn(8, 256, 1024, generator=torch.Generator().manual_seed(0)).to(CUDA) * 3
    hf_norm = LlamaRMSNorm(1024, eps=1e-6).to(CUDA)
    ours_norm = RMSNorm(1024, eps=1e-6).to_empty(device=CUDA)  # its weight is made on meta
    with torch.no_grad():
        hf_norm.weight.uniform_(0.5, 1.5)
        ours_norm.weight.copy_(hf_norm.weight)
    for ours, ref in ((GeLU("tanh"), NewGELUActivation()), (ours_norm, hf_norm)):
        ref_y, ref_g = _value_and_grad(copy.deepcopy(ref).double(), x.double())
        for dtype in (torch.float32, torch.bfloat16):
            y, g = _value_and_grad(copy.deepcopy(ours).to(dtype), x.to(dtype))
            tol = 1e-6 if dtype == torch.float32 else TOLERANCE[dtype]
            assert rel_error(y, ref_y) < tol and rel_error(g, ref_g) < tol, (type(ours).__name__, dtype)


def _value_and_grad(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    (y * torch.linspace(-1, 1, y.size(-1), device=x.device, dtype=y.dtype)).sum().backward()
    return y.detach(), x.grad


def test_chunked_cross_entropy_is_exact_and_lean():
    """bf16 logits of GPT-2's vocabulary over 8192 tokens (some ignored, some outside the
    vocabulary): the loss and the gradient as F.cross_entropy on fp32 logits, at a fraction of the
    memory that upcast takes."""
    logits = (torch.randn(8192, 50257, generator=torch.Generator().manual_seed(0)) * 4).to(CUDA, torch.bfloat16)
    target = torch.randint(0, 50257, (8192,), generator=torch.Generator().manual_seed(1)).to(CUDA)
    target[:3] = torch.tensor([-100, -1, 50257 + 5])
    known = target.masked_fill((target < 0) | (target >= 50257), -100)
    results, peaks = [], []
    for fn in (lambda x: chunked_cross_entropy(x, target),
               lambda x: F.cross_entropy(x.float(), known, reduction="none")):  # fmt: skip
        x = logits.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = fn(x)
        loss.sum().backward()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
        results.append((loss.detach().float(), x.grad.float()))
        del x, loss
    (loss, grad), (ref_loss, ref_grad) = results
    print(f"\nchunked CE: loss {rel_error(loss, ref_loss):.2e}, grad {rel_error(grad, ref_grad):.2e}; "
          f"peak MiB {peaks[0]:.0f} (F.cross_entropy on fp32 logits: {peaks[1]:.0f})")  # fmt: skip
    assert rel_error(loss, ref_loss) < 1e-6 and rel_error(grad, ref_grad) < TOLERANCE[torch.bfloat16]
    assert not loss[:3].any() and not grad[:3].any()
    assert peaks[0] < peaks[1] / 2


def _train(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps with the trainer's next-token loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = vocab_parallel_cross_entropy(model(input_ids=ids, use_cache=False).logits, ids.roll(-1, 1), None).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["gpt_fused", "gpt_fused, dropout 0.1", "llama_tp"])
def test_one_device_recipes_train_as_hf(recipe, dtype):
    """gpt_fused (compiled GPT-2 blocks; with dropout, the same masks as eager) and llama_tp (q|k|v
    and gate|up one GEMM each, F.rms_norm) on one GPU: five AdamW steps, each loss as HF's model's."""
    schedule = recipe.split(",")[0]
    if schedule == "gpt_fused":
        require_compiler()
        dropout = 0.1 if "dropout" in recipe else 0.0
        config = tiny_gpt2_config(n_embd=256, n_head=8, n_positions=128, vocab_size=512,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
    else:
        config = tiny_llama_config(hidden_size=256, intermediate_size=512, vocab_size=512, max_position_embeddings=128)
    seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).to(CUDA, dtype).train()
    sch = ms.create_schedule(copy.deepcopy(hf))
    get_schedule(schedule).apply(sch, config, argparse.Namespace(sequence_parallel=False))
    ours = ms.build(sch, init_weights=False).train()
    ids = _ids(4, 128, config.vocab_size)
    losses = []
    for model in (ours, hf):
        seed(1)  # the same dropout masks on both sides
        losses.append(_train(model, ids, 5))
    print(f"\n{recipe} {dtype}: losses {losses[0]} vs HF {losses[1]}")
    for got, want in zip(*losses, strict=True):
        assert abs(got - want) / abs(want) < TOLERANCE[dtype]
