"""Train an image classifier (WideResNet) with a megatron_slapo schedule.

    torchrun --nproc_per_node 2 pretrain_vision.py --schedule wideresnet_tp --tensor-model-parallel-size 2

On a generated image set (megatron_slapo/data/images.py), logging loss and top-1 accuracy on
Megatron's log line. Arguments are Megatron-LM's where it has them (see --help).
"""

from megatron_slapo.training.loop import main

if __name__ == "__main__":
    main("vision")
