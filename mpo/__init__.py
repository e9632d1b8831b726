"""mpo: reinforcement learning for Mixture-of-Experts language models on megatron-core and SGLang."""

from mpo import lean_imports as _lean_imports
from mpo import quiet as _quiet

_quiet.install()  # before torch or megatron is imported by anything under mpo
_lean_imports.install()

__version__ = "0.1.0"
