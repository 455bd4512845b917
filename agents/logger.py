"""TensorBoard logging with CleanRL's tag names (one ``SummaryWriter`` per run).

Tags written by :class:`mamba_rl.agents.RecurrentPPO` (named in :mod:`mamba_rl.agents.tags`):

* ``charts/episodic_return``, ``charts/episodic_length`` (one point per finished episode, at
  the global step it finished), ``charts/SPS``, ``charts/learning_rate``;
* ``losses/{value_loss, policy_loss, entropy, approx_kl, old_approx_kl, clipfrac,
  explained_variance}`` (CleanRL: last minibatch's losses, clipfrac averaged over the update) and
  ``losses/kl_stopped_steps`` (the update's planned minibatch steps a ``max_minibatch_kl`` stop left untaken);
* ``backbone/{grad_norm, loss_scale, overflow_skipped}`` (mean grad norm, last loss scale and
  the number of optimizer steps skipped over the update on a NaN / inf gradient: an f16 overflow, or
  a non-finite loss in any dtype);
* ``perf/{rollout_ms, update_ms}`` (wall time of the last rollout and update);
* with ``nonfinite="zero"``: ``env/{nonfinite_obs, nonfinite_rewards}`` (non-finite values the env
  returned and the guard replaced by 0, so far);
* the hyperparameters as a markdown table under the text tag ``hyperparameters``.

Every scalar of an update arrives here as a Python float after the agent's single
device-to-host copy per update, so logging never syncs the GPU by itself.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from .tags import EPISODIC_LENGTH, EPISODIC_RETURN, SCALAR_TAGS

__all__ = ["TensorBoardLogger", "SCALAR_TAGS", "hparams_markdown"]

def hparams_markdown(hparams: Mapping[str, Any]) -> str:
    """CleanRL's hyperparameter table: ``|param|value|`` markdown, one row per key."""
    rows = "\n".join(f"|{k}|{v}|" for k, v in hparams.items())
    return "|param|value|\n|-|-|\n" + rows


class TensorBoardLogger:
    """A thin wrapper over ``torch.utils.tensorboard.SummaryWriter`` for one run.

    Args:
        log_dir: the run folder, e.g. ``runs/{env}__{exp_name}__{seed}__{unix_time}``;
            created if missing (a resumed run appends a new event file to the same folder).
        enabled: False makes every method a no-op (no folder, no file).
        purge_step: a resumed run's first step after its checkpoint (global env steps): TensorBoard hides
            the events at steps >= purge_step that earlier event files of the folder hold (what the run
            resumed from had logged after its checkpoint), so no step shows twice. None: purge nothing.
    """

    def __init__(self, log_dir: str, enabled: bool = True, purge_step: int | None = None):
        self.log_dir = log_dir
        self.enabled = enabled
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(log_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir, purge_step=purge_step)

    def hparams(self, hparams: Mapping[str, Any]) -> None:
        """Write the hyperparameters as a markdown text table (tag ``hyperparameters``)."""
        if self._writer is not None:
            self._writer.add_text("hyperparameters", hparams_markdown(hparams))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write ``{tag: float}`` at ``step`` (global env steps)."""
        if self._writer is None:
            return
        for tag, value in values.items():
            self._writer.add_scalar(tag, float(value), int(step))

    def episodes(self, episodes: Iterable[tuple[int, float, int]]) -> None:
        """Write ``charts/episodic_return`` and ``_length`` for (step, return, length) triples."""
        if self._writer is None:
            return
        for step, ret, length in episodes:
            self._writer.add_scalar(EPISODIC_RETURN, float(ret), int(step))
            self._writer.add_scalar(EPISODIC_LENGTH, float(length), int(step))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
