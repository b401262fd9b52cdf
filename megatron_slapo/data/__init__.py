"""Training data: Megatron tokenizers, indexed datasets, samplers and the embedded corpus."""
