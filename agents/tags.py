"""The TensorBoard tag names of a run, in one place (CleanRL's names plus ``backbone/*`` and ``perf/*``).

Written by :class:`~mamba_rl.agents.RecurrentPPO` through :class:`~mamba_rl.agents.logger.TensorBoardLogger`,
produced by :meth:`~mamba_rl.agents.update.PPOUpdate.run` (:data:`UPDATE_METRICS`) and read back by
``mamba-rl plot``. No imports: the CLI's plot command reads it without torch.
"""

from __future__ import annotations

__all__ = ["EPISODIC_RETURN", "EPISODIC_LENGTH", "SPS", "LEARNING_RATE", "ROLLOUT_MS", "UPDATE_MS",
           "ROLLOUT_PARITY", "OVERFLOW_SKIPPED", "KL_STOPPED", "NONFINITE_OBS", "NONFINITE_REWARDS", "UPDATE_METRICS",
           "AUX_VALUE_LOSS", "AUX_EXPLAINED_VARIANCE", "AUX_METRICS", "ACTION_SET_LOSS", "SCALAR_TAGS"]

EPISODIC_RETURN = "charts/episodic_return"  # one point per finished episode, at the step it finished
EPISODIC_LENGTH = "charts/episodic_length"
SPS = "charts/SPS"  # env steps per second of the run so far (summed over ranks)
LEARNING_RATE = "charts/learning_rate"
ROLLOUT_MS = "perf/rollout_ms"  # wall time of the last rollout
UPDATE_MS = "perf/update_ms"  # wall time of the last update
ROLLOUT_PARITY = "debug/rollout_parity"  # max |new - stored| log-prob / value of an update's first minibatch
OVERFLOW_SKIPPED = "backbone/overflow_skipped"  # minibatch steps skipped on a NaN / inf gradient in the update
KL_STOPPED = "losses/kl_stopped_steps"  # the update's planned minibatch steps a max_minibatch_kl stop left untaken
NONFINITE_OBS = "env/nonfinite_obs"  # nonfinite="zero" only: non-finite values the env guard zeroed so far
NONFINITE_REWARDS = "env/nonfinite_rewards"

# what one update reports, in PPOUpdate.run's order: the last minibatch's losses, clipfrac averaged over the
# update, explained variance, mean grad norm (of the steps taken), the loss scale after the update, steps skipped on
# a non-finite gradient, steps skipped by max_minibatch_kl, parity
UPDATE_METRICS = ("losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/approx_kl",
                  "losses/old_approx_kl", "losses/clipfrac", "losses/explained_variance", "backbone/grad_norm",
                  "backbone/loss_scale", OVERFLOW_SKIPPED, KL_STOPPED, ROLLOUT_PARITY)

# with the two-horizon critic (PPOConfig.aux_gamma) only, after UPDATE_METRICS: the aux critic's value loss (the
# last minibatch's, before vf_coef) and its explained variance over the rollout's valid steps
AUX_VALUE_LOSS = "losses/aux_value_loss"
AUX_EXPLAINED_VARIANCE = "losses/aux_explained_variance"
AUX_METRICS = (AUX_VALUE_LOSS, AUX_EXPLAINED_VARIANCE)

# with the action-set loss (PPOConfig.action_set_coef > 0) only, last: its value on the last minibatch (before the
# coefficient)
ACTION_SET_LOSS = "losses/action_set_loss"

# every scalar tag a run writes (debug/* is kept in the history, not logged; env/* only with nonfinite="zero";
# AUX_METRICS only with aux_gamma, ACTION_SET_LOSS only with action_set_coef)
SCALAR_TAGS = (EPISODIC_RETURN, EPISODIC_LENGTH, SPS, LEARNING_RATE,
               *(t for t in UPDATE_METRICS if not t.startswith("debug/")), ROLLOUT_MS, UPDATE_MS)
