"""cut_pipeline_stage + the partitioner: stage modules whose chain equals the whole model."""

import copy
import re
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

import megatron_slapo as ms
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.pipeline import PipelineStages
from megatron_slapo.training.model import trace_for_pipeline
from tests.utils import tiny_bert_config, tiny_gpt2_config, tiny_llama_config

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

MODELS = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)), "transformer.h", {"use_cache": False},
             "transformer.wte.weight"),
    "bert": (lambda: transformers.BertForMaskedLM(tiny_bert_config(num_hidden_layers=4)), "bert.encoder.layer", {},
             "bert.embeddings.word_embeddings.weight"),
}  # fmt: skip


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("family", list(MODELS))
def test_stages_chain_to_the_whole_model(family, stages):
    make, layers, constants, tied_weight = MODELS[family]
    torch.manual_seed(0)
    model = make().eval()
    expected = model(IDS, **constants).logits
    sch = ms.create_schedule(model)
    sch.trace(example_inputs={"input_ids": IDS}, concrete_args=constants)
    starts = [1, 2, 3] if stages == 4 else [2]
    for i in starts:
        sch[f"{layers}.{i}"].cut_pipeline_stage()
    pipeline = ms.build(sch)
    assert isinstance(pipeline, PipelineStages) and len(pipeline.stages) == stages
    assert torch.equal(pipeline(input_ids=IDS, **constants).logits, expected)
    # Each stage runs on what the previous one hands over, and nothing else.
    values = pipeline.stages[0](input_ids=IDS, **constants)
    for k, stage in enumerate(pipeline.stages[1:]):
        assert len(values) == len(pipeline.plan.crossing[k])
        values = stage(*values)
    assert torch.equal(values.logits, expected)
    assert pipeline.plan.cut_paths == [f"{layers}.{i}" for i in starts]
    assert pipeline.plan.tied == {tied_weight: [0, stages - 1]}  # embedding and LM head share it
    stage_layers = [[n.target for n in s.graph.nodes if n.op == "call_module" and n.target.startswith(layers)]
                    for s in pipeline.stages]  # fmt: skip
    assert stage_layers[-1][0] == f"{layers}.{starts[-1]}"


def test_cut_errors():
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4))
    sch = ms.create_schedule(model)
    with pytest.raises(ms.SchedulingError, match=r"\[transformer.h.2\] cut_pipeline_stage\(\) needs a traced parent"):
        sch["transformer.h.2"].cut_pipeline_stage()
    sch.trace(example_inputs={"input_ids": IDS}, concrete_args={"use_cache": False})
    sch["transformer.h.2"].cut_pipeline_stage()
    with pytest.raises(ms.SchedulingError, match="already applied"):
        sch["transformer.h.2"].cut_pipeline_stage()


def test_stages_keep_dropout_mode_and_layers_used_by_checkpointed_parts():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))
    reference = copy.deepcopy(model).train()
    sch = ms.create_schedule(model)
    sch.trace(example_inputs={"input_ids": IDS}, concrete_args={"use_cache": False})
    sch["transformer"].checkpoint(subgraph=sch["transformer"].find("^ln_f$")[0])  # a weight used only inside
    sch["transformer.h.2"].cut_pipeline_stage()
    pipeline = ms.build(sch)
    params = {id(p) for stage in pipeline.stages for p in stage.parameters()}
    assert params == {id(p) for p in sch.mod.parameters()}  # ln_f's weights too, though only the part calls them
    for mode in ("train", "eval"):
        pipeline.train(mode == "train")
        reference.train(mode == "train")
        torch.manual_seed(5)
        expected = reference(IDS, use_cache=False).logits
        torch.manual_seed(5)
        assert torch.equal(pipeline(input_ids=IDS, use_cache=False).logits, expected), mode


def test_megatron_engine_refuses_plans_its_schedules_cannot_run():
    from megatron_slapo.engines.stage_chunk import check_plan
    from megatron_slapo.errors import ConfigError

    def cut(*paths):
        sch = ms.create_schedule(transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)))
        sch.trace(example_inputs={"input_ids": IDS}, concrete_args={"use_cache": False})
        for path in paths:
            sch[path].cut_pipeline_stage()
        return ms.build(sch, recompute_pipeline_inputs=True)

    pipeline = cut("transformer.h.1", "transformer.h.2")
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)).eval()
    state = model.state_dict()
    for stage in pipeline.stages:  # stages after the first recompute what derives from the inputs alone
        stage.load_state_dict({k: state[k] for k in stage.state_dict()})
    pipeline.eval()
    assert torch.equal(pipeline(input_ids=IDS, use_cache=False).logits, model(IDS, use_cache=False).logits)
    check_plan(pipeline)  # one hidden state per cut; the embedding shared by the first and last stage
    pipeline.plan.tied["transformer.h.0.ln_1.weight"] = [0, 1]
    with pytest.raises(ConfigError, match=r"used by pipeline stages \[0, 1\]; only the first and the last"):
        check_plan(pipeline)
    with pytest.raises(ConfigError, match="cut_pipeline_stage at 'transformer.h.1.mlp': 2 values cross it"):
        check_plan(cut("transformer.h.1.mlp"))  # the residual and the normalised input both cross


# -- values derived from the inputs alone (pipeline_inputs) -------------------------------------------------------

DECODERS = {  # 4 layers; OPT's pad id is in IDS, so its tied embedding's padding row matters
    "gpt2": (lambda: transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)), 4),
    "gpt_neo": (lambda: transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
        vocab_size=128, max_position_embeddings=64, hidden_size=32, num_layers=4, num_heads=4,
        attention_types=[[["global", "local"], 2]], window_size=8, resid_dropout=0.0, embed_dropout=0.0,
        attention_dropout=0.0)), 4),
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=128, max_position_embeddings=64, hidden_size=32, num_hidden_layers=4, ffn_dim=64,
        num_attention_heads=4, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, pad_token_id=1)), 4),
    "llama": (lambda: transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)), 4),
}  # fmt: skip
GPT_TASK = SimpleNamespace(inputs=lambda batch: {"input_ids": batch["tokens"], "use_cache": False})


@pytest.mark.parametrize("family", list(DECODERS))
def test_decoder_stages_start_from_one_process_weights_and_pass_one_activation(family):
    """The trainer's path: trace the layers' ancestors, cut, build with recomputed inputs. Each stage
    holds the weights one process builds, one hidden state crosses the cut (Llama's rotary cos/sin
    are recomputed, though the rotary module is called with the hidden states), and the chain
    reproduces the model's logits and gradients."""
    make, num_layers = DECODERS[family]
    with torch.device("meta"):
        plain, model = make(), make()
    reference = ms.build(ms.create_schedule(plain), seed=3).train()
    sch = ms.create_schedule(model)
    layers = transformer_layers(model, num_layers)
    trace_for_pipeline(sch, GPT_TASK, SimpleNamespace(micro_batch_size=2), layers, seq_length=12)
    sch[layers[2]].cut_pipeline_stage()
    pipeline = ms.build(sch, seed=3, recompute_pipeline_inputs=True).train()
    assert [len(values) for values in pipeline.plan.crossing] == [1], pipeline.plan.crossing
    state = reference.state_dict()
    for stage in pipeline.stages:  # tracing keeps the module order build initialises units in
        for name, tensor in stage.state_dict().items():
            assert torch.equal(tensor, state[name]), name
    expected, logits = reference(IDS, use_cache=False).logits, pipeline(input_ids=IDS, use_cache=False).logits
    assert torch.equal(logits, expected)
    expected.square().mean().backward()
    logits.square().mean().backward()
    grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    for stage in pipeline.stages:
        for name, p in stage.named_parameters():
            assert torch.allclose(p.grad, grads[name], rtol=0, atol=1e-6), name
    if family == "llama":
        called = [n.target for n in pipeline.stages[1].graph.nodes if n.op == "call_module"]
        assert "model.rotary_emb" in called  # recomputed in stage 1, from position ids and inv_freq


def test_a_traced_parameter_free_module_is_recomputed_with_a_stand_in_its_guard_accepts():
    """Traced all the way down, Llama's rotary embedding is a guarded graph: the later stage calls
    it with an uninitialised tensor of the shape and dtype it was traced for, not the activation."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4)).eval()
    expected = model(IDS, use_cache=False).logits
    sch = ms.create_schedule(model)
    sch.trace(example_inputs={"input_ids": IDS}, concrete_args={"use_cache": False})
    sch["model.layers.2"].cut_pipeline_stage()
    pipeline = ms.build(sch, recompute_pipeline_inputs=True).eval()
    assert [len(values) for values in pipeline.plan.crossing] == [1], pipeline.plan.crossing
    assert torch.equal(pipeline(input_ids=IDS, use_cache=False).logits, expected)
    stand_ins = [n for n in pipeline.stages[1].graph.nodes if n.target is torch.empty]
    assert len(stand_ins) == 1


class _Frequencies(nn.Module):
    """Rotary-like: reads only the device of ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(1.0, 5.0))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return (positions[..., None].float() * self.inv_freq.to(x.device)).cos()


class _Scale(nn.Module):
    """Parameter-free too, but reads the values of ``x``."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x * positions[..., None]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.freq, self.scale, self.drop = _Frequencies(), _Scale(), nn.Dropout(0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        positions = torch.arange(ids.shape[1], device=h.device)[None]  # derived: a device read and constants
        cos = self.freq(h, positions)  # derived: h is read for its device only
        scaled = self.scale(h, positions)  # not derived: reads h's values
        noise = self.drop(positions.float())  # not derived: random, though from derived values
        return h * cos + scaled + noise + torch.rand_like(cos)  # rand_like: random


class _Leaves(torch.fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return isinstance(module, (_Frequencies, _Scale)) or super().is_leaf_module(module, qualname)


def test_input_derived_is_an_ancestry_rule_over_parameters_randomness_and_what_modules_read():
    from megatron_slapo.pipeline_inputs import input_derived

    root = _Model()
    gm = torch.fx.GraphModule(root, _Leaves().trace(root))  # freq and scale stay module calls
    found = input_derived(gm)
    names = {n.name for n in found.nodes}
    assert {"ids", "arange", "getitem", "freq"} <= names
    assert not names & {"embed", "scale", "drop", "rand_like", "add_2"}, names
    call, h = next(n for n in gm.graph.nodes if n.name == "freq"), next(n for n in gm.graph.nodes if n.name == "embed")
    assert (call, h) not in found.stand_ins  # untraced: a recomputing stage passes its received activation


# -- what the partitioner would drop -----------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["", "transformer"])
@pytest.mark.parametrize(
    "primitive, found",
    [
        (lambda s: s.sync("fwd_pre", lambda x: x), r"sync\('fwd_pre', '<lambda>'\)"),
        (lambda s: s.hook("fwd_post", lambda m, args, out: out), r"1 hook\(s\)"),
        (lambda s: s.checkpoint(), r"checkpoint\(\)"),
    ],
    ids=["sync", "hook", "checkpoint"],
)
def test_partitioner_refuses_primitives_on_levels_it_takes_apart(level, primitive, found):
    """The root and the levels inlined on the way to a cut become stage graphs: a sync, hook or
    checkpoint on them would silently never run, so building the pipeline refuses them."""
    sch = ms.create_schedule(transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4)))
    sch.trace(example_inputs={"input_ids": IDS}, concrete_args={"use_cache": False})
    primitive(sch[level] if level else sch)
    sch["transformer.h.2"].cut_pipeline_stage()
    where = re.escape(f"[{level or '<root>'}]")
    with pytest.raises(ms.SchedulingError, match=rf"{where} {found} on this traced level would be dropped"):
        ms.build(sch)
