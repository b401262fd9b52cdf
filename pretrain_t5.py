"""Pretrain a HuggingFace T5 with a megatron_slapo schedule.

    .venv/bin/torchrun --nproc_per_node 2 pretrain_t5.py --schedule t5_tp --tensor-model-parallel-size 2

Megatron's span corruption on its T5 dataset (sentinels from --vocab-extra-ids); the encoder's
length is --seq-length (--encoder-seq-length), the decoder's --decoder-seq-length. Arguments are
Megatron-LM's (see --help).
"""

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import tools.repo_python  # noqa: F401

from megatron_slapo.training.loop import main

if __name__ == "__main__":
    main("t5")
