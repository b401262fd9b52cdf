"""Model definitions the project ships because no installed package has them (WideResNet).

Importing ``megatron_slapo`` registers them with transformers' Auto classes, so that
``AutoConfig`` / ``AutoModelForImageClassification.from_pretrained`` load their directories.
"""

from megatron_slapo.models.wideresnet import WideResNetForImageClassification

# class name (as checkpoints record it) -> class, for the classes transformers itself lacks
MODEL_CLASSES = {cls.__name__: cls for cls in (WideResNetForImageClassification,)}
