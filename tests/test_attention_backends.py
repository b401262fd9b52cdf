"""--attention-backend flash/fused: HF's SDPA path on only those kernels, equal to eager attention."""

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend

from megatron_slapo.kernels import attention
from tests.test_bad_input import GPT, SIZES, TRAIN, one_error_line
from tests.utils import tiny_bert_config, tiny_gpt2_config, tiny_llama_config

PADDED = torch.tensor([[1] * 12, [1] * 8 + [0] * 4])  # the second sequence padded: a non-causal mask with holes
MODELS = {  # causal; causal with grouped-query attention (4 heads, 2 key/value heads); padded, bidirectional
    "gpt2": (transformers.GPT2LMHeadModel, tiny_gpt2_config, None),
    "llama-gqa": (transformers.LlamaForCausalLM, tiny_llama_config, None),
    "bert-padded": (transformers.BertForPreTraining, tiny_bert_config, PADDED),
}


def _run(name: str, implementation: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cls, config, mask = MODELS[name]
    torch.manual_seed(0)
    model = cls(config()).to(dtype).eval()
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    out = model(ids, attention_mask=mask)
    logits = out.logits if hasattr(out, "logits") else out.prediction_logits
    (logits.float() * torch.linspace(-1, 1, logits.size(-1))).sum().backward()
    return logits.float(), [p.grad.float() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("name", MODELS)
def test_sdpa_on_one_kernel_equals_eager_attention(name, backend):
    """fp32: outputs and every gradient; bf16: outputs, within bf16's precision."""
    logits, grads = _run(name, attention.implementation(backend), torch.float32)
    ref_logits, ref_grads = _run(name, "eager", torch.float32)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    scale = max(float(r.abs().max()) for r in ref_grads)  # some gradients are (near) zero: one absolute scale
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * scale)
    half, _ = _run(name, attention.implementation(backend), torch.bfloat16)
    half_ref, _ = _run(name, "eager", torch.bfloat16)
    torch.testing.assert_close(half, half_ref, rtol=2**-6, atol=2**-6 * float(half_ref.abs().max()))


def test_a_kernel_that_cannot_run_fails_instead_of_falling_back(monkeypatch):
    """Restricted to kernels torch cannot use (cuDNN's never takes CPU tensors), the attention
    raises, where torch's own SDPA would have fallen back to another kernel unnoticed."""
    monkeypatch.setitem(attention.KERNELS, "fused", (SDPBackend.CUDNN_ATTENTION,))
    assert (
        attention.unavailable("fused", torch.device("cpu"), 0.0)
        == "torch has no fused attention kernel on cpu in float32"
    )
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(RuntimeError):
        attention._attention(attention.KERNELS["fused"], torch.nn.Module(), q, q, q, None, is_causal=True)


def test_the_trainer_refuses_a_backend_without_a_kernel_in_one_line(monkeypatch, capsys):
    """The kernel is probed at the run's precision: a GPU's flash attention takes only 16-bit inputs."""
    probed = []

    def unavailable(backend, device, dropout, dtype):
        probed.append(dtype)
        return f"torch has no {backend} kernel"

    monkeypatch.setattr(attention, "unavailable", unavailable)
    for precision in ([], ["--bf16"]):
        argv = [*GPT, *SIZES, *TRAIN, "--attention-backend", "flash", *precision]
        assert one_error_line("gpt", argv, capsys) == (
            "--attention-backend flash: torch has no flash kernel; use --attention-backend auto (torch picks a "
            "kernel) or unfused"
        )
    assert probed == [torch.float32, torch.bfloat16]


def test_a_model_without_sdpa_attention_is_refused_in_one_line(capsys):
    argv = [*GPT, *SIZES, *TRAIN, "--model-type", "gpt_neo", "--attention-backend", "flash", "--attention-dropout", "0"]
    assert one_error_line("gpt", argv, capsys) == (
        "--attention-backend flash: the HF gpt_neo model has no SDPA attention; use --attention-backend auto or unfused"
    )
