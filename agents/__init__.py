"""Recurrent PPO on gymnasium with the Mamba backbone as memory (``mamba_rl.agents``).

Main entry points: :class:`RecurrentPPO` (``learn``, ``predict``, ``evaluate``, ``save``/``load``)
and :class:`PPOConfig` (CleanRL's PPO defaults). Building blocks: :class:`Policy` (backbone +
heads, acting), :func:`evaluate_policy`, :func:`compute_gae`, :class:`RolloutBuffer` /
:class:`RolloutCarry` (the rollout's storage and carried state), :class:`Minibatch`, :class:`PPOUpdate`,
:class:`Run` / :class:`Progress`, :class:`ActorHead`, :class:`CriticHead`, :class:`TensorBoardLogger`.
"""

from __future__ import annotations

from mamba_rl._lazy import lazy_exports

# Public name -> defining submodule, imported on first use (PEP 562): the CLI's ``--help`` needs only the
# configs, not torch or gymnasium.
_EXPORTS = {
    "PPOConfig": ".config", "RecurrentPPO": ".ppo", "Policy": ".policy", "PolicyState": ".policy",
    "EvalResult": ".evaluate", "evaluate_policy": ".evaluate", "compute_gae": ".gae", "RolloutBuffer": ".rollout",
    "RolloutCarry": ".rollout", "Minibatch": ".loss", "PPOUpdate": ".update", "Run": ".runs", "Progress": ".runs",
    "ActionDist": ".heads", "ActorHead": ".heads", "CriticHead": ".heads", "action_dim": ".heads",
    "action_input_dim": ".heads", "SCALAR_TAGS": ".tags", "TensorBoardLogger": ".logger",
    "hparams_markdown": ".logger",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
