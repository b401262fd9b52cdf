"""Pretrain a HuggingFace masked LM (BERT, RoBERTa, ALBERT) with a megatron_slapo schedule.

    .venv/bin/torchrun --nproc_per_node 2 pretrain_bert.py --schedule bert_tp --tensor-model-parallel-size 2

Masked-LM plus sentence-order prediction (BERT, ALBERT; --bert-no-binary-head for MLM only), on
Megatron's BERT dataset. Arguments are Megatron-LM's (see --help).
"""

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import tools.repo_python  # noqa: F401

from megatron_slapo.training.loop import main

if __name__ == "__main__":
    main("bert")
