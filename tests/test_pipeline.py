"""cut_pipeline_stage + the partitioner: stage modules whose chain equals the whole model."""

import copy

import pytest
import torch
import transformers

import megatron_slapo as ms
from megatron_slapo.pipeline import PipelineStages
from tests.utils import tiny_bert_config, tiny_gpt2_config

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
    from megatron_slapo.engines.megatron_core import _check_plan
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
    _check_plan(pipeline)  # one hidden state per cut; the embedding shared by the first and last stage
    pipeline.plan.tied["transformer.h.0.ln_1.weight"] = [0, 1]
    with pytest.raises(ConfigError, match=r"used by pipeline stages \[0, 1\]; only the first and the last"):
        _check_plan(pipeline)
    with pytest.raises(ConfigError, match="cut_pipeline_stage at 'transformer.h.1.mlp': 2 values cross it"):
        _check_plan(cut("transformer.h.1.mlp"))  # the residual and the normalised input both cross
