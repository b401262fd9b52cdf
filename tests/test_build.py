"""build(): meta models materialised deterministically; real weights left alone."""

import math

import pytest
import torch
import transformers
from torch import nn

import megatron_slapo as ms
from tests.utils import tiny_bert_config, tiny_gpt2_config, tiny_llama_config


def meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_same_seed_same_weights_and_hf_init_scheme():
    cfg = tiny_gpt2_config()
    a = ms.build(ms.create_schedule(meta(transformers.GPT2LMHeadModel, cfg)), seed=5)
    b = ms.build(ms.create_schedule(meta(transformers.GPT2LMHeadModel, cfg)), seed=5)
    c = ms.build(ms.create_schedule(meta(transformers.GPT2LMHeadModel, cfg)), seed=6)
    sa, sb, sc = state(a), state(b), state(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["transformer.h.0.mlp.c_fc.weight"], sc["transformer.h.0.mlp.c_fc.weight"])
    assert not any(t.is_meta for t in a.parameters())
    assert a.lm_head.weight is a.transformer.wte.weight
    # HF's GPT-2 init: LayerNorm = (1, 0), Conv1D bias 0, residual projections scaled by 1/sqrt(2L).
    assert torch.equal(sa["transformer.h.0.ln_1.weight"], torch.ones(cfg.n_embd))
    assert torch.equal(sa["transformer.h.0.attn.c_attn.bias"], torch.zeros(3 * cfg.n_embd))
    fc_std = sa["transformer.h.0.mlp.c_fc.weight"].std().item()
    proj_std = sa["transformer.h.0.mlp.c_proj.weight"].std().item()
    assert abs(fc_std - cfg.initializer_range) < 0.003
    assert abs(proj_std - cfg.initializer_range / math.sqrt(2 * cfg.n_layer)) < 0.003
    loss = a(torch.randint(0, 128, (2, 8)), labels=torch.randint(0, 128, (2, 8))).loss
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.2


@pytest.mark.parametrize(
    "cls, cfg",
    [
        (transformers.BertForMaskedLM, tiny_bert_config()),  # meta buffers: position_ids, token_type_ids
        (transformers.LlamaForCausalLM, tiny_llama_config()),  # meta buffer: rotary inv_freq
    ],
    ids=["bert", "llama"],
)
def test_buffers_are_materialised_like_a_real_construction(cls, cfg):
    torch.manual_seed(0)
    real = cls(cfg).eval()
    built = ms.build(ms.create_schedule(meta(cls, cfg)), seed=0).eval()
    real_buffers = dict(real.named_buffers())
    for name, buf in built.named_buffers():
        assert torch.equal(buf, real_buffers[name]), name
    built.load_state_dict(real.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.equal(built(ids).logits, real(ids).logits)


def test_real_weights_are_untouched_and_only_meta_ones_built():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    before = state(model)
    weight = model.transformer.h[1].mlp.c_fc.weight
    with torch.device("meta"):
        model.transformer.h[0].mlp.c_fc = transformers.pytorch_utils.Conv1D(128, 32)
    ms.build(ms.create_schedule(model), seed=0)
    after = state(model)
    assert model.transformer.h[1].mlp.c_fc.weight is weight
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["transformer.h.0.mlp.c_fc.weight"]  # its bias is HF-initialised to zeros, as before
    assert not any(t.is_meta for t in model.parameters())
    assert not hasattr(weight, "_is_hf_initialized")  # build's temporary protection is removed


def test_init_weights_callable_and_disabled():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    ms.build(
        ms.create_schedule(model),
        init_weights=lambda m: [nn.init.constant_(p, 0.5) for p in m.parameters(recurse=False)],
    )
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    ms.build(ms.create_schedule(model), init_weights=False)
    assert torch.isnan(model[0].weight).all()  # left for a checkpoint to fill, visibly unset


def test_plain_modules_use_reset_parameters_and_unknown_params_are_an_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    ms.build(ms.create_schedule(model), seed=0)
    assert model[0].weight.abs().max() <= 1 / math.sqrt(4)  # torch's kaiming-uniform bound

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.empty(4))

    with torch.device("meta"):
        model = nn.Sequential(Scale())
    with pytest.raises(ms.SchedulingError, match=r"Scale.gain was not initialised"):
        ms.build(ms.create_schedule(model))


def test_fork_rng_without_seeded_stream_fails_before_compute():
    from megatron_slapo.parallel.random import get_rng_tracker

    get_rng_tracker().reset()
    sch = ms.create_schedule(nn.Sequential(nn.Dropout(0.1)))
    sch["0"].fork_rng()
    with pytest.raises(ms.SchedulingError, match=r"\[0\] fork_rng\(\) needs the model-parallel RNG stream"):
        ms.build(sch)


def test_unwritten_buffer_of_any_dtype_is_an_error():
    class Flags(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.zeros(4, dtype=torch.bool))

    with torch.device("meta"):
        model = nn.Sequential(Flags())
    with pytest.raises(ms.SchedulingError, match=r"Flags.mask was not initialised"):
        ms.build(ms.create_schedule(model))
    with torch.device("meta"):
        model = nn.Sequential(Flags())
    ms.build(ms.create_schedule(model), init_weights=lambda m: [b.zero_() for b in m.buffers(recurse=False)])
    assert model[0].mask.dtype == torch.bool and not model[0].mask.any()


def test_a_layer_sharded_only_through_a_tie_must_be_scheduled():
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    sch = ms.create_schedule(model)
    sch["transformer.wte"].shard("weight", axis=0)
    sch["transformer.wte"].sync("fwd_post", "all_reduce")
    with pytest.raises(ms.SchedulingError, match=r"\[lm_head\] 'weight' is tied to a tensor sharded elsewhere"):
        ms.build(sch)


def test_init_functions_may_write_through_data_or_assign_it():
    """``.data`` shares the storage but not the version counter: such writes count as writes."""

    def init(module):
        for name, p in module.named_parameters(recurse=False):
            if name == "weight":
                p.data.normal_()  # in place through .data
            else:
                p.data = torch.full_like(p, 0.25)  # a new tensor assigned to .data
        for b in module.buffers(recurse=False):
            b.data.fill_(3)

    class WithCounter(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_buffer("count", torch.zeros(2, dtype=torch.long))

    with torch.device("meta"):
        model = nn.Sequential(WithCounter(), nn.LayerNorm(4))
    ms.build(ms.create_schedule(model), init_weights=init, seed=0)
    assert model[0].weight.std() > 0.2 and torch.equal(model[0].bias, torch.full((4,), 0.25))
    assert torch.equal(model[0].count, torch.full((2,), 3)) and torch.equal(model[1].bias, torch.full((4,), 0.25))

    with torch.device("meta"):
        model = nn.Sequential(WithCounter())
    with pytest.raises(ms.SchedulingError, match=r"WithCounter.count was not initialised"):
        ms.build(ms.create_schedule(model), init_weights=lambda m: [p.data.zero_() for p in m.parameters(False)])
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ms.SchedulingError, match=r"replaced Linear.weight with a torch.float32 tensor of shape \(2,\)"):
        ms.build(ms.create_schedule(model), init_weights=lambda m: [setattr(p, "data", torch.zeros(2)) for p in
                                                                   m.parameters(recurse=False)])  # fmt: skip


NEO = transformers.GPTNeoConfig(
    vocab_size=128, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=4, window_size=8,
    attention_types=[[["global", "local"], 1]], embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
    bos_token_id=0, eos_token_id=0)  # fmt: skip
MODELS = {
    "gpt2": (transformers.GPT2LMHeadModel, tiny_gpt2_config(), {"use_cache": False}),  # GPT2Attention's scaled c_proj
    "gpt_neo": (transformers.GPTNeoForCausalLM, NEO, {"use_cache": False}),  # causal-mask buffer set by isinstance
    "llama": (transformers.LlamaForCausalLM, tiny_llama_config(), {"use_cache": False}),  # rotary inv_freq
    "bert": (transformers.BertForMaskedLM, tiny_bert_config(), None),  # buffers computed on in forward
}


@pytest.mark.parametrize("flatten", [False, True], ids=["levels", "flat"])
@pytest.mark.parametrize("name", list(MODELS))
def test_initial_values_do_not_depend_on_tracing(name, flatten):
    """Tracing registers children in graph order and turns classes HF's _init_weights dispatches on
    into GraphModules; build still initialises every tensor as in the untraced model."""
    cls, cfg, constants = MODELS[name]
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    untraced = ms.build(ms.create_schedule(meta(cls, cfg)), seed=3)
    sch = ms.create_schedule(meta(cls, cfg))
    sch.trace(example_inputs={"input_ids": ids}, concrete_args=constants, flatten=flatten)
    traced = ms.build(sch, seed=3)
    expected = {**untraced.state_dict(), **dict(untraced.named_buffers())}
    got = {**traced.state_dict(), **dict(traced.named_buffers())}
    assert list(traced.state_dict()) == list(untraced.state_dict())  # same keys: non-persistent buffers stay so
    assert [k for k in got if not torch.equal(got[k], expected[k])] == []  # buffers fx dropped are unused
    assert torch.equal(traced.eval()(ids, **(constants or {})).logits, untraced.eval()(ids).logits)
