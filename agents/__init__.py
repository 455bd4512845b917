"""Recurrent PPO on gymnasium with the Mamba backbone as memory (``mamba_rl.agents``).

Main entry points: :class:`RecurrentPPO` (``learn``, ``predict``, ``evaluate``, ``save``/``load``)
and :class:`PPOConfig` (CleanRL's PPO defaults). Building blocks: :class:`Policy` (backbone +
heads, acting), :func:`evaluate_policy`, :func:`compute_gae`, :class:`RolloutBuffer`,
:class:`ActorHead`, :class:`CriticHead`, :class:`TensorBoardLogger`.
"""

from __future__ import annotations

from .config import PPOConfig
from .evaluate import EvalResult, evaluate_policy
from .gae import compute_gae
from .heads import ActionDist, ActorHead, CriticHead, action_dim, action_input_dim, encode_prev_action
from .logger import SCALAR_TAGS, TensorBoardLogger, hparams_markdown, run_name_for
from .policy import Policy, PolicyState
from .ppo import RecurrentPPO
from .rollout import RolloutBuffer

__all__ = [
    "PPOConfig", "RecurrentPPO", "Policy", "PolicyState", "EvalResult", "evaluate_policy", "compute_gae",
    "RolloutBuffer", "ActionDist", "ActorHead", "CriticHead", "action_dim", "action_input_dim",
    "encode_prev_action", "SCALAR_TAGS", "TensorBoardLogger", "hparams_markdown", "run_name_for",
]
