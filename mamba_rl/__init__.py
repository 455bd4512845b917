"""mamba_rl: a Mamba-1 (selective state-space) recurrent backbone with a fused trainer, for RL.

Layers (docs/architecture.md): :mod:`mamba_rl.ops` (kernels and their float64-capable references),
:mod:`mamba_rl.model` (arena, block, backbone, stepper), :mod:`mamba_rl.train` (trainer, scaler,
checkpoints), :mod:`mamba_rl.agents` (recurrent PPO) and :mod:`mamba_rl.envs` (gymnasium / POMDP tasks).

Public API: :class:`MambaConfig`, :class:`MambaBackbone`, :class:`RecurrentState`, :class:`Stepper`,
:class:`MambaTrainer`, :class:`StepMetrics`, :func:`save_checkpoint`, :func:`load_checkpoint`,
:func:`read_checkpoint`, :class:`CheckpointError`.
"""
from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

# Public name -> the submodule that defines it. Imported on first use (PEP 562), so that ``import
# mamba_rl.config`` or the CLI's ``--help`` does not pay for importing torch.
_EXPORTS = {
    "MambaConfig": ".config",
    "MambaBackbone": ".model", "MambaBlock": ".model", "RecurrentState": ".model", "Stepper": ".model",
    "MambaTrainer": ".train", "StepMetrics": ".train", "save_checkpoint": ".train", "load_checkpoint": ".train",
    "read_checkpoint": ".train", "CheckpointError": ".train",
}

__all__ = [*_EXPORTS, "__version__"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
