"""Recurrent PPO on gymnasium with the Mamba backbone as memory (``mamba_rl.agents``).

Main entry points: :class:`RecurrentPPO` (``learn``, ``predict``, ``evaluate``, ``save``/``load``)
and :class:`PPOConfig` (CleanRL's PPO defaults). Building blocks: :func:`compute_gae`,
:class:`RolloutBuffer`, :class:`ActorHead`, :class:`CriticHead`, :class:`TensorBoardLogger`.
"""

from .config import PPOConfig
from .gae import compute_gae
from .heads import ActionDist, ActorHead, CriticHead, action_dim, action_input_dim, encode_prev_action
from .logger import SCALAR_TAGS, TensorBoardLogger, hparams_markdown
from .rollout import RolloutBuffer

__all__ = [
    "PPOConfig", "RecurrentPPO", "PolicyState", "EvalResult", "compute_gae", "RolloutBuffer",
    "ActionDist", "ActorHead", "CriticHead", "action_dim", "action_input_dim", "encode_prev_action",
    "SCALAR_TAGS", "TensorBoardLogger", "hparams_markdown",
]


def __getattr__(name):  # RecurrentPPO needs the backbone/trainer; import it lazily
    if name in ("RecurrentPPO", "PolicyState", "EvalResult"):
        from . import ppo

        return getattr(ppo, name)
    raise AttributeError(f"module 'mamba_rl.agents' has no attribute {name!r}")
