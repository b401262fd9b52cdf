"""Dynamic primitives in one process: replace, hook, annotate, checkpoint, and their misuse."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

import megatron_slapo as ms
from megatron_slapo.parallel import seed
from tests.utils import max_diff, tiny_gpt2_config


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class MyLinear(nn.Linear):
    """A user's replacement implementation with the same parameters."""

    def forward(self, x):
        return x @ self.weight.t() + self.bias


# ----- replace ---------------------------------------------------------------------------------
def test_replace_keeps_weights_and_hooks():
    torch.manual_seed(0)
    model = TwoLayer().eval()
    x = torch.randn(3, 8)
    expected = model(x)
    sch = ms.create_schedule(model)
    calls = []
    sch["fc1"].hook("fwd_post", lambda mod, args, out: calls.append(type(mod).__name__))
    old_weight = model.fc1.weight
    sch["fc1"].replace(MyLinear(8, 16))
    assert isinstance(model.fc1, MyLinear) and sch["fc1"].mod is model.fc1
    assert model.fc1.weight is old_weight  # the same tensor: pretrained values and ties survive
    assert max_diff(model(x), expected) == 0
    assert calls == ["MyLinear"]


def test_replace_with_a_function_and_replace_all():
    torch.manual_seed(0)
    model = nn.Sequential(TwoLayer(), TwoLayer()).eval()
    x = torch.randn(3, 8)
    expected = model(x)
    sch = ms.create_schedule(model)
    sch["0.act"].replace(F.gelu)
    assert max_diff(model(x), expected) == 0
    paths = sch.replace_all(nn.Linear, lambda path, old: MyLinear(old.in_features, old.out_features))
    assert paths == ["0.fc1", "0.fc2", "1.fc1", "1.fc2"]
    assert all(isinstance(m, MyLinear) for m in (model[0].fc1, model[1].fc2))
    assert max_diff(model(x), expected) == 0


def test_replace_gpt2_mlp_keeps_pretrained_logits():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config()).eval()
    ids = torch.randint(0, 128, (2, 10))
    expected = model(ids).logits
    sch = ms.create_schedule(model)
    cfg = model.config
    sch.replace_all(GPT2MLP, lambda path, old: GPT2MLP(4 * cfg.n_embd, cfg))  # fresh module, old weights
    assert max_diff(model(ids).logits, expected) == 0


def test_replace_errors_name_the_path():
    sch = ms.create_schedule(TwoLayer())
    with pytest.raises(TypeError, match=r"\[fc1\] replace\(\) expects an nn.Module or a callable"):
        sch["fc1"].replace(42)
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\].*same name but another shape: weight"):
        sch["fc1"].replace(nn.Linear(8, 4))
    with pytest.raises(ms.SchedulingError, match="cannot replace the root"):
        sch.replace(TwoLayer())
    sch["fc2"].checkpoint()
    with pytest.raises(ms.SchedulingError, match=r"fc2 already has checkpoint"):
        sch["fc2"].replace(nn.Linear(16, 8))
    sch["fc1"].replace(nn.Linear(8, 4), keep_weights=False)


# ----- hook / annotate ---------------------------------------------------------------------------
def test_hook_modes_and_errors():
    model = TwoLayer()
    sch = ms.create_schedule(model)
    seen = []
    sch["fc1"].hook("fwd_pre", lambda mod, args: seen.append("pre"))
    sch["fc1"].hook("bwd_post", lambda mod, gin, gout: seen.append("bwd"))
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert seen == ["pre", "bwd"]
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] unknown hook mode 'fwd'"):
        sch["fc1"].hook("fwd", print)


def test_annotation_survives_shard_and_build():
    with torch.device("meta"):
        model = TwoLayer()
    sch = ms.create_schedule(model)
    sch["fc1"].annotate("weight", "allreduce", False)
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=0)
    ms.build(sch, seed=0)
    assert not model.fc1.weight.is_meta and model.fc1.weight.allreduce is False
    assert sch["fc1"].metadata.annotations == {"weight": {"allreduce": False}}
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] Linear has no parameter or buffer 'wieght'"):
        sch["fc1"].annotate("wieght", "x", 1)


# ----- checkpoint ----------------------------------------------------------------------------------
def test_checkpoint_gives_equal_gradients_and_replays_dropout():
    results = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = TwoLayer().train()
        if checkpointed:
            ms.create_schedule(model).checkpoint()
        seed(3)
        x = torch.randn(4, 8, requires_grad=True)
        out = model(x)
        out.square().sum().backward()
        results.append([out, x.grad, *(p.grad for p in model.parameters())])
    for plain, recomputed in zip(*results, strict=True):
        assert torch.equal(plain, recomputed)


def test_checkpoint_frees_activations():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(32, 64, requires_grad=True)

    def saved_bytes(m):
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel()) or t, lambda t: t):
            m(x).sum()
        return sum(total)

    plain = saved_bytes(model)
    ms.create_schedule(model).checkpoint()
    assert saved_bytes(model) < plain / 2


# ----- misuse ------------------------------------------------------------------------------------
def test_invalid_syncs_raise_with_the_path():
    sch = ms.create_schedule(TwoLayer())
    sch["fc1"].shard("weight", axis=0)
    sch["fc1"].shard("bias", axis=0)
    sch["fc2"].shard("weight", axis=1)
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] invalid sync\('fwd_post', 'all_reduce'\).*partitioned"):
        sch["fc1"].sync("fwd_post", "all_reduce")
    with pytest.raises(ms.SchedulingError, match=r"\[fc2\] invalid sync\('fwd_post', 'all_gather'\).*partial sum"):
        sch["fc2"].sync("fwd_post", "all_gather")
    with pytest.raises(ms.SchedulingError, match=r"\[fc2\] invalid sync\('bwd_post'.*row-parallel"):
        sch["fc2"].sync("bwd_post", "all_reduce")
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] invalid sync\('fwd_pre'.*column-parallel"):
        sch["fc1"].sync("fwd_pre", "all_reduce")
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] unknown sync op 'allreduce'"):
        sch["fc1"].sync("bwd_post", "allreduce")
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] unknown sync mode 'bwd'"):
        sch["fc1"].sync("bwd", "all_reduce")
    with pytest.raises(TypeError, match=r"\[fc1\] sync op must be a name or a callable"):
        sch["fc1"].sync("bwd_post", 3)
    sch["fc2"].sync("fwd_post", "all_reduce")
    with pytest.raises(ms.SchedulingError, match=r"\[fc2\] sync\('fwd_post', 'all_reduce'\) is already applied"):
        sch["fc2"].sync("fwd_post", "all_reduce")


def test_shard_misuse_raises_with_the_path():
    sch = ms.create_schedule(TwoLayer())
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] axis 2 is out of range for 'weight' of shape \(16, 8\)"):
        sch["fc1"].shard("weight", axis=2)
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\].*not divisible by the group size 1 x stride 3"):
        sch["fc1"].shard("weight", axis=0, stride=3)
    sch["fc1"].shard("weight", axis=-2)
    assert sch["fc1"].metadata.shards["weight"].axis == 0
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] 'weight' is already sharded"):
        sch["fc1"].shard("weight", axis=0)
    with pytest.raises(ms.SchedulingError, match=r"\[fc1\] column-parallel layer: shard its bias too"):
        ms.build(sch)
    with pytest.raises(ms.SchedulingError, match=r"\[fc2\] checkpoint\(\) is already applied"):
        sch["fc2"].checkpoint()
        sch["fc2"].checkpoint()
    sch["act"].fork_rng()
    with pytest.raises(ms.SchedulingError, match=r"\[act\] fork_rng\(\) is already applied"):
        sch["act"].fork_rng()


def test_sync_before_shard_on_a_biased_row_layer_is_rejected():
    sch = ms.create_schedule(TwoLayer())
    sch["fc2"].sync("fwd_post", "all_reduce")
    with pytest.raises(ms.SchedulingError, match=r"\[fc2\] shard\(\) a row-parallel layer before sync\(\)"):
        sch["fc2"].shard("weight", axis=1)


def test_all_gather_on_an_unknown_module_needs_an_explicit_backward():
    sch = ms.create_schedule(TwoLayer())
    with pytest.raises(ms.SchedulingError, match=r"\[act\] all_gather on a module whose sharding is unknown"):
        sch["act"].sync("fwd_post", "all_gather", axis=1)
    sch["act"].sync("fwd_post", "all_gather", axis=1, backward="split")


def test_replace_keeps_its_own_syncs_but_refuses_to_drop_descendants():
    model = nn.Sequential(TwoLayer())
    sch = ms.create_schedule(model)
    sch["0.fc1"].sync("fwd_post", lambda t: 2 * t)
    with pytest.raises(ms.SchedulingError, match=r"\[0\] 0.fc1 already has sync"):
        sch["0"].replace(TwoLayer())
    handle = sch["0.fc1"].hook("fwd_post", lambda m, a, out: out + 1)
    sch["0.fc1"].replace(MyLinear(8, 16))
    x = torch.randn(2, 8)
    assert max_diff(model[0].fc1(x), 2 * F.linear(x, model[0].fc1.weight, model[0].fc1.bias) + 1) == 0
    handle.remove()  # handles from before the replace still work
    assert max_diff(model[0].fc1(x), 2 * F.linear(x, model[0].fc1.weight, model[0].fc1.bias)) == 0


def test_deepcopy_of_a_scheduled_model_is_independent():
    import copy

    torch.manual_seed(0)
    model = TwoLayer().eval()
    sch = ms.create_schedule(model)
    sch["fc2"].shard("weight", axis=1)  # row-parallel with a bias: forward rewritten
    sch["fc1"].checkpoint()
    clone = copy.deepcopy(model)
    sch["fc2"].sync("fwd_post", lambda t: 10 * t)  # only on the original
    x = torch.randn(3, 8)
    with torch.no_grad():
        clone.fc2.weight.zero_()
    assert max_diff(clone(x), clone.fc2.bias.expand(3, 8)) == 0  # the clone computes with its own weights
    hidden = F.gelu(model.fc1(x))
    expected = 10 * F.linear(hidden, model.fc2.weight, model.fc2.bias)  # a user function sees the output
    assert max_diff(model(x), expected) < 1e-6


def test_patched_modules_accept_keyword_inputs():
    model = TwoLayer()
    sch = ms.create_schedule(model)
    sch["fc1"].checkpoint()  # forward becomes a PatchedForward(*args, **kwargs)
    sch["fc1"].sync("fwd_pre", lambda t: 2 * t)
    x = torch.randn(2, 8, requires_grad=True)
    assert max_diff(model.fc1(input=x), F.linear(2 * x, model.fc1.weight, model.fc1.bias)) == 0


def test_verify_must_wrap_the_whole_schedule():
    sch = ms.create_schedule(TwoLayer())
    sch["fc1"].checkpoint()
    with pytest.raises(ms.VerificationError, match="fc1 already has primitives"):
        with ms.Verify(sch, [torch.randn(2, 8)]):
            pass


def test_single_process_verify_passes_and_reports():
    sch = ms.create_schedule(TwoLayer().eval())
    with ms.Verify(sch, [torch.randn(2, 8)]) as verify:
        sch["fc1"].checkpoint()
        sch["act"].replace(F.gelu)
    assert verify.report.outputs["output"] == 0 and len(verify.report.grads) == 4
