"""Pretrain a HuggingFace masked LM (BERT, RoBERTa, ALBERT) with a megatron_slapo schedule.

    torchrun --nproc_per_node 2 pretrain_bert.py --schedule bert_tp --tensor-model-parallel-size 2

Masked-LM plus sentence-order prediction (BERT, ALBERT; --bert-no-binary-head for MLM only), on
Megatron's BERT dataset. Arguments are Megatron-LM's (see --help).
"""

from megatron_slapo.training.loop import main

if __name__ == "__main__":
    main("bert")
