"""Pretrain a HuggingFace causal LM (GPT-2, GPT-Neo, OPT, Llama) with a megatron_slapo schedule.

    .venv/bin/torchrun --nproc_per_node 2 pretrain_gpt.py --schedule gpt_tp --tensor-model-parallel-size 2

Arguments are Megatron-LM's (see --help). With no --data-path it trains a small GPT-2 on a corpus
that ships with Python, so the command above runs anywhere.
"""

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import tools.repo_python  # noqa: F401

from megatron_slapo.training.loop import main

if __name__ == "__main__":
    main("gpt")
