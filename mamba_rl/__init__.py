"""mamba_rl: a Mamba-1 (selective state-space) recurrent backbone with a fused trainer, for RL.

Layers (docs/architecture.md): :mod:`mamba_rl.ops` (kernels and their float64-capable references),
:mod:`mamba_rl.model` (arena, block, backbone, stepper), :mod:`mamba_rl.train` (trainer, scaler,
checkpoints), :mod:`mamba_rl.agents` (recurrent PPO) and :mod:`mamba_rl.envs` (gymnasium / POMDP tasks).

Public API: :class:`MambaConfig`, :class:`MambaBackbone`, :class:`RecurrentState`, :class:`Stepper`,
:class:`MambaTrainer`, :class:`StepMetrics`, :func:`save_checkpoint`, :func:`load_checkpoint`,
:func:`read_checkpoint`, :class:`CheckpointError`.
"""
from .config import MambaConfig
from .model import MambaBackbone, MambaBlock, RecurrentState, Stepper
from .train import (CheckpointError, MambaTrainer, StepMetrics, load_checkpoint, read_checkpoint,
                    save_checkpoint)

__version__ = "0.1.0"

__all__ = ["MambaConfig", "RecurrentState", "MambaBackbone", "MambaBlock", "Stepper", "MambaTrainer",
           "StepMetrics", "save_checkpoint", "load_checkpoint", "read_checkpoint", "CheckpointError",
           "__version__"]
