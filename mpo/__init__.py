"""mpo: reinforcement learning for Mixture-of-Experts language models on megatron-core and SGLang."""

__version__ = "0.1.0"
