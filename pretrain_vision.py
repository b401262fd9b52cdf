"""Train an image classifier (WideResNet) with a megatron_slapo schedule.

    .venv/bin/torchrun --nproc_per_node 2 pretrain_vision.py --schedule wideresnet_tp --tensor-model-parallel-size 2

On a generated image set (megatron_slapo/data/images.py), logging loss and top-1 accuracy on
Megatron's log line. Arguments are Megatron-LM's where it has them (see --help).
"""

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import tools.repo_python  # noqa: F401

from megatron_slapo.training.loop import main

if __name__ == "__main__":
    main("vision")
