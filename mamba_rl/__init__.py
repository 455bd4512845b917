"""mamba_rl: a Mamba-1 (selective state-space) recurrent backbone with a fused CUDA trainer, for RL.

Public API (ARCHITECTURE.md section 4): :class:`MambaConfig`, :class:`MambaBackbone`,
:class:`RecurrentState`, :class:`MambaTrainer`, :class:`StepMetrics`, :func:`save_checkpoint`,
:func:`load_checkpoint`. The agent layer is :mod:`mamba_rl.agents`, the envs :mod:`mamba_rl.envs`.
"""
from .config import MambaConfig
from .state import RecurrentState
from .backbone import MambaBackbone

__version__ = "0.1.0"

__all__ = ["MambaConfig", "RecurrentState", "MambaBackbone", "MambaTrainer", "StepMetrics",
           "save_checkpoint", "load_checkpoint", "__version__"]


def __getattr__(name):  # lazy: keep `import mamba_rl` light
    if name in ("MambaTrainer", "StepMetrics"):
        from . import trainer
        return getattr(trainer, name)
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'mamba_rl' has no attribute {name!r}")
