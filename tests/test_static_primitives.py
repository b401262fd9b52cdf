"""find / replace(target_ops) / decompose / fuse / checkpoint(subgraph) on traced graphs."""

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Block

import megatron_slapo as ms
from megatron_slapo.kernels.qkv import FusedQKV
from tests.utils import tiny_bert_config, tiny_gpt2_config


def traced(module, *inputs, **kwargs):
    sch = ms.create_schedule(module)
    sch.trace(example_inputs=inputs if len(inputs) > 1 else inputs[0], **kwargs)
    return sch


class Chains(nn.Module):
    """relu(a + b) twice (functional and module forms), and a diamond."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()
        self.gelu = nn.GELU()
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        a = F.relu(x + y)
        b = self.act(y + x)  # module form, operands swapped
        c = self.gelu(a) + F.relu(a)  # diamond: a -> gelu, relu -> add
        s = x * y  # a tree: one value, two consumers, two outputs
        return self.q(c) + self.k(c) * self.v(c), b, torch.tanh(s), torch.sigmoid(s), x - 1.0


X, Y = torch.randn(3, 4), torch.randn(3, 4)


# ----- find ----------------------------------------------------------------------------------------
def test_exact_and_functional_vs_module_matches():
    sch = traced(Chains(), X, Y)
    found = sch.find(lambda a, b: F.relu(a + b))
    assert len(found) == 2
    assert [op_name(n) for n in found[1].nodes] == ["add", "act"]  # F.relu matched the nn.ReLU call
    assert found[0].bindings["a"].name == "x" and found[1].bindings["a"].name == "y"  # operands in either order


def op_name(node):
    return node.target if node.op == "call_module" else getattr(node.target, "__name__", node.target)


def test_tree_and_diamond_matches():
    sch = traced(Chains(), X, Y)

    def diamond(a):
        return F.gelu(a) + torch.relu(a)

    (match,) = sch.find(diamond)
    assert [n.name for n in match.nodes] == ["gelu", "relu_1", "add_2"]
    assert match.inputs[0].name == "relu"

    def tree(a, b):
        s = a * b
        return torch.tanh(s), torch.sigmoid(s)

    (match,) = sch.find(tree)
    assert [n.name for n in match.nodes] == ["mul", "tanh", "sigmoid"] and len(match.outputs) == 2

    def not_there(a, b):
        s = a + b
        return F.relu(s), s * 2

    assert sch.find(not_there) == []  # no "s * 2" in the graph: the whole pattern must match


def test_constants_must_match():
    sch = traced(Chains(), X, Y)
    assert len(sch.find(lambda a: a - 1.0)) == 1
    assert sch.find(lambda a: 1.0 - a) == []  # operand order of "-" matters
    assert sch.find(lambda a: a - 2.0) == []


class AttentionLike(nn.Module):
    def forward(self, x):
        p = F.softmax(x, dim=-1)
        return F.dropout(p, p=0.1, training=self.training) + x


def test_functional_dropout_and_softmax_match_with_their_arguments():
    sch = traced(AttentionLike(), X)  # the training flag becomes a runtime switch: still matched
    assert len(sch.find(lambda a, r: F.dropout(a, p=0.1) + r)) == 1
    assert sch.find(lambda a, r: F.dropout(a, p=0.2) + r) == []
    assert len(sch.find(lambda a: F.softmax(a, dim=-1))) == 1
    assert sch.find(lambda a: F.softmax(a, dim=0)) == []


def test_regex_and_horizontal_matches():
    sch = traced(Chains(), X, Y)
    qkv = sch.find(r"^[qkv]$")
    assert [s.paths for s in qkv] == [["q"], ["k"], ["v"]]
    assert all(s.inputs == qkv[0].inputs for s in qkv)  # parallel branches on one input
    with pytest.raises(ms.SchedulingError, match="trace"):
        ms.create_schedule(Chains()).find("q")


# ----- replace ----------------------------------------------------------------------------------------
def test_vertical_replace_with_a_function_and_a_module_moving_hooks():
    model = Chains()
    expected = model(X, Y)
    sch = traced(copy.deepcopy(model), X, Y)
    calls = []
    sch["act"].hook("fwd_post", lambda m, a, out: calls.append(1))
    subgraphs = sch.find(lambda a, b: F.relu(a + b))
    sch.replace(lambda a, b: torch.relu(a + b), target_ops=subgraphs[0])

    class AddReLU(nn.Module):
        def forward(self, a, b):
            return torch.relu(a + b)

    sch.replace(AddReLU(), target_ops=subgraphs[1], name="add_relu")
    got = sch.mod(X, Y)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert "act" not in sch.child and "add_relu" in sch.child and calls == [1]  # the hook moved


def test_horizontal_replace_refuses_the_branches_hooks():
    """On the fused call q's pre-hook would also change k's and v's input (as Slapo, refused)."""
    sch = traced(Chains(), X, Y)
    handle = sch["q"].hook("fwd_pre", lambda m, args: (args[0] * 2,))
    branches = sch.find(r"^[qkv]$")
    fused = FusedQKV.from_linears(sch["q"].mod, sch["k"].mod, sch["v"].mod)
    with pytest.raises(ms.SchedulingError, match=r"the fwd_pre hook\(s\) of q would run once for every branch"):
        sch.replace(fused, target_ops=branches, name="qkv")
    assert {"q", "k", "v"} <= set(sch.child)  # nothing changed
    handle.remove()
    sch.replace(fused, target_ops=branches, name="qkv")
    assert "qkv" in sch.child and not {"q", "k", "v"} & set(sch.child)


def test_replace_refuses_a_subgraph_used_from_outside():
    sch = traced(Chains(), X, Y)

    def add_only(a, b):
        return a + b

    first = sch.find(add_only)[0]  # x + y, whose value feeds relu too
    sch.replace(lambda a, b: a + b, target_ops=first)  # fine: it is the output
    (bigger,) = sch.find(lambda a: F.gelu(a) + torch.relu(a))
    bigger.outputs = [bigger.nodes[0]]  # pretend only gelu's value is produced
    with pytest.raises(ms.SchedulingError, match="also used outside it"):
        sch.replace(lambda a: a, target_ops=bigger)


def test_fused_qkv_on_hf_bert_keeps_pretrained_weights_and_logits(tmp_path):
    torch.manual_seed(0)
    transformers.BertForMaskedLM(tiny_bert_config()).save_pretrained(tmp_path)
    model = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 12))
    expected = model(ids).logits
    sch = traced(model, {"input_ids": ids})
    for i in range(2):
        attn = sch[f"bert.encoder.layer.{i}.attention.self"]
        branches = attn.find(r"^(query|key|value)$")
        fused = FusedQKV.from_linears(attn["query"].mod, attn["key"].mod, attn["value"].mod)
        attn.replace(fused, target_ops=branches, name="qkv")
        assert list(attn.child) == ["dropout", "qkv"]  # q, k, v are gone; the dropout (its p is read) stays
    assert torch.allclose(sch.mod(ids).logits, expected, atol=1e-5, rtol=0)


# ----- decompose / fuse -------------------------------------------------------------------------------
def gpt2_block():
    torch.manual_seed(0)
    block = GPT2Block(tiny_gpt2_config(resid_pdrop=0.1), layer_idx=0)
    for p in block.parameters():
        nn.init.normal_(p, std=0.1)  # nonzero biases
    return block.eval()


H = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))


def bias_gelu(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def bias_dropout_add(x, bias, residual):
    return F.dropout(x + bias, p=0.1) + residual


def test_decompose_before_and_after_tracing():
    block = gpt2_block()
    expected = block(H)
    for after in (False, True):
        sch = ms.create_schedule(copy.deepcopy(block))
        if after:
            sch.trace(example_inputs={"hidden_states": H}, flatten=True)
        sch["mlp.c_fc"].decompose()
        if not after:
            sch.trace(example_inputs={"hidden_states": H}, flatten=True)
        assert len(sch.find(bias_gelu)) == 1
        assert torch.allclose(sch.mod(H), expected, atol=1e-6, rtol=0)
    with pytest.raises(ms.SchedulingError, match="applies to nn.Linear or HF Conv1D"):
        ms.create_schedule(block)["ln_1"].decompose()


def test_fuse_bias_gelu_and_bias_dropout_add_with_inductor():
    reference = gpt2_block()
    sch = ms.create_schedule(copy.deepcopy(reference))
    sch["mlp.c_fc"].decompose()
    sch["attn.c_proj"].decompose()
    sch.trace(example_inputs={"hidden_states": H}, flatten=True)
    sch.fuse(sch.find(bias_gelu)[0], name="bias_gelu")
    sch.fuse(sch.find(bias_dropout_add)[0], name="bias_dropout_add")
    assert {"bias_gelu", "bias_dropout_add"} <= set(sch.child)
    x_ref, x = H.clone().requires_grad_(), H.clone().requires_grad_()
    expected, got = reference(x_ref), sch.mod(x)  # eval mode: dropout is the identity in both
    w = torch.randn_like(expected) / expected.numel()
    (expected * w).sum().backward()
    (got * w).sum().backward()
    assert (got - expected).abs().max() < 1e-6
    assert (x.grad - x_ref.grad).abs().max() < 1e-6
    grads = dict(sch.mod.named_parameters())
    assert set(grads) == {n for n, _ in reference.named_parameters()}  # fusing adds no parameters
    for name, p in reference.named_parameters():
        assert (grads[name].grad - p.grad).abs().max() < 1e-6, name
    sch.mod.train()
    dropped = (sch["bias_dropout_add"].mod(torch.ones(4096), torch.zeros(4096), torch.zeros(4096)) == 0).float()
    assert 0.05 < dropped.mean() < 0.15  # dropout is live in training mode


def test_fuse_refuses_a_subgraph_with_two_outputs():
    sch = traced(Chains(), X, Y)
    (two,) = sch.find(lambda a, b: (F.relu(a + b), a + b))
    with pytest.raises(ms.SchedulingError, match="only single-output \\(vertical\\) subgraphs fit"):
        sch.fuse(two)


# ----- checkpoint(subgraph) ---------------------------------------------------------------------------
def test_partial_checkpoint_gives_equal_gradients():
    torch.manual_seed(0)
    mlp = GPT2MLP(128, tiny_gpt2_config())
    reference = copy.deepcopy(mlp)
    sch = ms.create_schedule(mlp)
    sch.trace(example_inputs=H, flatten=True)
    (part,) = sch.find(lambda x: F.gelu(x, approximate="tanh"))
    sch.checkpoint(subgraph=part)
    assert "checkpointed" in sch.child
    x_ref, x = H.clone().requires_grad_(), H.clone().requires_grad_()
    reference(x_ref).square().sum().backward()
    sch.mod(x).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    for (name, p), (_, q) in zip(sch.mod.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        sch.mod(H.clone().requires_grad_())
    assert saved.count(torch.Size([2, 8, 128])) == 1  # only the input: gelu's input and output are recomputed


def test_a_later_replace_keeps_layers_a_checkpointed_subgraph_uses():
    model = Chains()
    expected = model.eval()(X, Y)
    sch = traced(copy.deepcopy(model), X, Y)
    (part,) = sch.find(lambda a: F.gelu(a) + torch.relu(a))
    sch.checkpoint(subgraph=part)  # calls the "gelu" layer from inside
    sch.replace(lambda a, b: torch.relu(a + b), target_ops=sch.find(lambda a, b: F.relu(a + b))[1])
    assert "gelu" in sch.child and "act" not in sch.child
    assert all(torch.equal(g, e) for g, e in zip(sch.mod(X, Y), expected, strict=True))


def test_decompose_refuses_to_drop_a_traced_layers_hooks():
    sch = ms.create_schedule(gpt2_block())
    sch.trace(example_inputs={"hidden_states": H}, flatten=True)
    sch["mlp.c_fc"].hook("fwd_post", lambda m, a, o: None)
    with pytest.raises(ms.SchedulingError, match="decompose it before tracing"):
        sch["mlp.c_fc"].decompose()


class DropoutAdd(nn.Module):
    def forward(self, x, y):
        return F.dropout(x, 0.5, training=self.training) + y


@pytest.mark.parametrize("same_input", [False, True], ids=["two-inputs", "one-value-twice"])
def test_a_checkpointed_subgraph_follows_train_and_eval(same_input):
    """Functional dropout reads the mode at run time, also inside the extracted graph (which is not
    a registered child); and one value may bind two of the pattern's inputs."""
    inputs = (X, X) if same_input else (X, Y)
    sch = traced(DropoutAdd(), *inputs)
    (part,) = sch.find(lambda a, r: F.dropout(a, p=0.5) + r)
    sch.checkpoint(subgraph=part)
    model = sch.mod
    torch.manual_seed(0)
    assert not torch.equal(model(*inputs), X + inputs[1])  # training: half the entries dropped
    model.eval()
    assert torch.equal(model(*inputs), X + inputs[1])
    model.train()
    assert not torch.equal(model(*inputs), X + inputs[1])
