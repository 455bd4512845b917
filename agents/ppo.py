"""Recurrent PPO (Schulman et al. 2017) whose memory is the Mamba backbone and its fused trainer.

Loop (docs/architecture.md, "Agent loop"), per update:

1. Rollout: the backbone acts for ``num_steps`` steps in ``num_envs`` gymnasium envs. Its state at
   the rollout start is stored as the update's initial state; it carries across rollouts and is
   reset only per env at episode starts, inside the kernel. The host stages each step's input in
   numpy (:func:`mamba_rl.agents.rollout.collect_rollout`); on CUDA one graph replay per step runs
   backbone, heads, sampling and device storage (:class:`~mamba_rl.agents.device_actor.GraphActor`),
   elsewhere (the CPU, or CUDA without graphs) the backbone and heads run eagerly and sampling /
   storage happen on the host (:class:`~mamba_rl.agents.rollout.EagerActor`).
2. Advantages: GAE under NextStep autoreset (:func:`mamba_rl.agents.gae.compute_gae`): the reset
   step after a done is never a transition; a truncation bootstraps with V(final obs) computed
   with the pre-reset state.
3. Update (:class:`~mamba_rl.agents.update.PPOUpdate`): ``update_epochs`` x ``num_minibatches``
   minibatches, each a fixed-shape slice over envs ``[num_envs / num_minibatches, num_steps]`` with
   its stored initial state and episode_starts: gather, ``trainer.forward_body``, heads,
   :func:`mamba_rl.agents.loss.ppo_loss`, ``trainer.backward_body`` (one global clip over heads +
   backbone, AdamW) and the head Adam with the same clip, skipped with the backbone on an f16
   overflow; one CUDA graph replay per minibatch on the GPU, one host sync per update.

:class:`RecurrentPPO` composes :class:`~mamba_rl.agents.policy.Policy` (network, acting),
:mod:`~mamba_rl.agents.evaluate` and :mod:`~mamba_rl.agents.checkpoint`. Defaults and TensorBoard
tags follow CleanRL (Huang et al. 2022); the same code runs on the CPU (the ``cpu`` kernel backend by
default, ``reference`` on request) and on CUDA. The agent builds its parts and hands each module the
typed pieces it works on: the rollout a :class:`~mamba_rl.agents.rollout.RolloutCarry` and a
:class:`~mamba_rl.agents.rollout.RolloutBuffer`, the update the policy, trainer, head optimizer and
buffer, the checkpoints all of them plus the :class:`~mamba_rl.agents.runs.Run` and its
:class:`~mamba_rl.agents.runs.Progress`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from mamba_rl import CheckpointError, MambaTrainer
from mamba_rl.envs import (EnvFailure, EnvGuard, VecNormalizeObservation, env_part_rows, find_vector_wrapper,
                           flatten_observation, joined_already, make_vec_env, raw_observation_space)

from .checkpoint import (Rngs, agent_config, check_envs_file, checkpoint_file, load_envs, read_agent_meta,
                         restore_agent, save_agent)
from .config import OVERLAP_MIN_ENVS, PPOConfig
from .device_actor import GraphActor
from .devices import resolve_device
from .distributed import (DataParallel, RunningStatsSync, rank as dist_rank, shard_permutation,
                          world_size as dist_world_size)
from .evaluate import EvalResult, evaluate_policy, obs_normaliser, reward_scale_of
from .head_optim import FlatHeadAdam
from .interrupts import deferred_signals, interrupt_once
from .logger import TensorBoardLogger
from .policy import Policy, PolicyState, prev_action_input
from .progress import StepProgress, apply_thread_policy, notice
from .rollout import EagerActor, RolloutBuffer, RolloutCarry, adopt_vec_env, collect_rollout
from .runs import Progress, Run, claim_run, new_run_name
from .tags import (LEARNING_RATE, NONFINITE_OBS, NONFINITE_REWARDS, OVERFLOW_SKIPPED, ROLLOUT_MS, SPS,
                   UPDATE_MS)
from .update import PPOUpdate

__all__ = ["RecurrentPPO"]


class RecurrentPPO:
    """Recurrent PPO agent: Mamba backbone memory, linear actor/critic heads, gymnasium envs.

    Args:
        env: an env id (str), a ``gymnasium.vector.VectorEnv`` built by the caller (its sub-env
            count must equal ``config.num_envs``; it should use NextStep autoreset and
            RecordEpisodeStatistics, as :func:`mamba_rl.envs.make_vec_env` does), or None to
            build ``config.env_id``.
        config: :class:`PPOConfig` (defaults when None).
        **overrides: PPOConfig fields that replace those of ``config``.

    Observation spaces: any space gymnasium can flatten (Box, Discrete, MultiDiscrete and
    Tuple/Dict of them; discrete parts one-hot). Action spaces: Discrete, MultiDiscrete, Box.

    Attributes: ``config``, ``policy`` (:class:`Policy`: backbone ``policy.net``, ``policy.heads``,
    acting), ``trainer`` (backbone AdamW), ``head_optimizer``, ``stepper`` (rollout, batch num_envs),
    ``buffer`` (:class:`RolloutBuffer`), ``carry`` (:class:`RolloutCarry`), ``rngs`` (:class:`Rngs`),
    ``run`` (:class:`Run`), ``progress`` (:class:`Progress`: ``global_step``, ``update``,
    ``recent_returns``, also readable as attributes of the agent), ``history`` (per-update metrics).

    Raises:
        ValueError: bad config, or a vector env whose sub-env count or autoreset mode differs.
        TypeError: an unsupported action space.
    """

    def __init__(self, env: str | gym.vector.VectorEnv | None = None, config: PPOConfig | None = None,
                 **overrides: Any):
        config = config if config is not None else PPOConfig()
        if isinstance(env, str):
            overrides["env_id"] = env
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.device = resolve_device(config.device, config.backend)
        # data-parallel (agents/distributed.py): num_envs is per rank, rank r's envs are seeded as envs
        # r*num_envs.. of one process; weights, minibatch order and lr schedule are shared by all ranks
        self.world_size, self.rank = dist_world_size(), dist_rank()
        self.env_seed = config.seed + self.rank * config.num_envs
        self.run = Run(new_run_name(config))
        self.progress = Progress()
        self._logger: TensorBoardLogger | None = None
        self._num_updates: int | None = None  # fixed while learn() runs
        self._predict_generator: torch.Generator | None = None
        self._raw_obs_space: gym.Space | None = None
        own_envs = env is None or isinstance(env, str)  # built here from config.env_id
        if config.joint_action and not own_envs and not joined_already(env):
            # the agent's own restore hands back its unpickled envs, already joined
            raise ValueError(f"PPOConfig.joint_action wraps the envs the agent builds; a given vector env must be "
                             f"joined already (its sub-envs wrapped in mamba_rl.envs.JointAction): expected a Discrete "
                             f"action space of JointAction sub-envs, got {env.single_action_space!r}")
        self.envs = self._make_envs() if own_envs else adopt_vec_env(env, config.num_envs, nonfinite=config.nonfinite)

        apply_thread_policy(config.threads)  # before the model is built (PPOConfig.threads)
        torch.manual_seed(config.seed)
        use_prev_action = prev_action_input(config.prev_action, self.envs, config.env_id if own_envs else None)
        self.policy = p = Policy(config.backbone, int(np.prod(self.envs.single_observation_space.shape)),
                                 self.envs.single_action_space, self.device, config.seed, backend=config.backend,
                                 prev_action=use_prev_action, prev_reward=config.prev_reward,
                                 memoryless=config.memoryless, aux_critic=config.aux_gamma is not None,
                                 time_encoding=config.time_encoding, action_set=config.action_set_coef > 0)
        # the heads' Adam over one flat arena: on CUDA a device step inside the update graph (no sync per step),
        # on the CPU one host-side step of torch.optim.Adam's arithmetic over the whole arena (bit for bit)
        self.head_optimizer = FlatHeadAdam(p.heads.parameters(), lr=config.learning_rate, eps=config.adam_eps)
        self.trainer = MambaTrainer(p.net, batch=config.envs_per_minibatch, seq_len=config.num_steps,
                                    dtype=config.dtype, lr=config.learning_rate, betas=(0.9, 0.999),
                                    eps=config.adam_eps, weight_decay=config.weight_decay,
                                    no_decay="reference", max_grad_norm=config.max_grad_norm,
                                    skip_nonfinite=True)  # a NaN / inf step is skipped in every dtype (counted)
        self.dp = DataParallel() if self.world_size > 1 else None
        # data-parallel: the envs' running normalisation statistics, merged over the ranks once per update
        self.stats_sync = RunningStatsSync(self.envs) if self.dp is not None else None
        if self.dp is not None:
            self._sync_ranks()
        self.stepper = p.net.stepper(batch=config.num_envs)
        graphs = config.cuda_graphs and self.device.type == "cuda"
        self.env_parts = self._env_parts()
        self._warned_pickle = False

        # the eager path samples on the CPU with rngs.sample; the graph path with the device's RNG
        self.rngs = Rngs(sample=torch.Generator().manual_seed(config.seed + self.rank),
                         minibatch=np.random.default_rng(config.seed))
        self.buffer = RolloutBuffer(config.num_envs, config.num_steps, p.input_dim, p.obs_dim, p.action_dim,
                                    p.discrete_actions, self.stepper.state,
                                    storage_device=self.device if graphs else torch.device("cpu"),
                                    aux=config.aux_gamma is not None)
        self.carry = RolloutCarry.zeros(config.num_envs, p.obs_dim, p.action_dim, p.discrete_actions)
        aux = dict(aux_gamma=config.aux_gamma, aux_gae_lambda=config.aux_gae_lambda)  # the two-horizon critic
        self.actor = (GraphActor(p, self.stepper, self.buffer, config.gamma, config.gae_lambda, parts=self.env_parts,
                                 **aux)
                      if graphs else
                      EagerActor(p, self.stepper, self.buffer, self.rngs.sample, config.gamma, config.gae_lambda,
                                 parts=self.env_parts, **aux))
        self.updater = PPOUpdate(config, p, self.trainer, self.head_optimizer, self.buffer, self.dp, capture=graphs)
        self.last_env_ms = 0.0  # env.step time of the last rollout (benchmarks: host overhead = rollout - env)
        self.history: list[dict[str, float]] = []
        self.interrupted_checkpoint: Path | None = None  # the `interrupted` folder saved by learn(), if any
        self.failed_checkpoint: Path | None = None  # the `env_failed` folder saved by learn(), if any
        # why learn()'s `interrupted` / `env_failed` save failed ("TypeName: message"); None where it was not tried
        self.stop_save_error: str | None = None
        self._warned_nonfinite = False
        self.last_episodes: list[tuple[int, float, int]] = []  # (global_step, return, length) of the last rollout

    # ------------------------------------------------------------- progress
    @property
    def global_step(self) -> int:
        """Env steps taken, all ranks together (``progress.global_step``)."""
        return self.progress.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.progress.global_step = value

    @property
    def update(self) -> int:
        """Whole updates done (``progress.update``)."""
        return self.progress.update

    @update.setter
    def update(self, value: int) -> None:
        self.progress.update = value

    @property
    def lr_plan(self) -> tuple[float, float, float] | None:
        """The lr anneal (``progress.lr_plan``; see :meth:`current_lr`)."""
        return self.progress.lr_plan

    @lr_plan.setter
    def lr_plan(self, value: tuple[float, float, float] | None) -> None:
        self.progress.lr_plan = value

    @property
    def recent_returns(self) -> deque:
        """The raw returns of the last 100 finished episodes (``progress.recent_returns``)."""
        return self.progress.recent_returns

    @property
    def run_name(self) -> str:
        """The run's name (``run.name``): its folder under ``runs_dir`` and ``checkpoint_dir``."""
        return self.run.name

    def _sync_ranks(self) -> None:
        """Rank 0's weights on every rank (equal from the seed anyway) and per-rank sampling RNGs."""
        net, heads = self.policy.net, self.policy.heads
        cfg = {k: v for k, v in self.config.to_dict().items() if k not in ("runs_dir", "checkpoint_dir", "device")}
        self.dp.check_same("the PPOConfig", cfg)
        self.dp.check_same("the parameter count", (net.arena.numel(), sum(p.numel() for p in heads.parameters())))
        ts = [net.arena] + [p.data for p in heads.parameters()]
        if net.compute_arena is not None and net.compute_arena.data_ptr() != net.arena.data_ptr():
            ts.append(net.compute_arena)
        self.dp.broadcast_weights(ts)
        # device sampling (CUDA graph actor) differs per rank
        torch.manual_seed(self.config.seed + 1000 * self.update + self.rank)

    @property
    def num_updates(self) -> int:
        """Updates in the run: ``update`` + the updates of ``batch_size * world_size`` env steps still needed
        to reach ``total_timesteps`` (fixed when :meth:`learn` starts). ``total_timesteps`` and ``global_step``
        count the env steps of all ranks together, so a run resumed on another world size still stops at
        (about) ``total_timesteps``; on the same world size this is ceil(total_timesteps / (batch_size * world))."""
        if self._num_updates is not None:
            return self._num_updates
        c = self.config
        left = max(0, c.total_timesteps - self.global_step)
        return self.update + -(-left // (c.batch_size * self.world_size))

    # ------------------------------------------------------------------ envs
    def _make_envs(self) -> gym.vector.VectorEnv:
        c = self.config
        # two halves where make_vec_env can (the EnvPool backend, >= 2 envs); it builds one part elsewhere
        halves = c.env_overlap == "on" or (c.env_overlap == "auto" and c.num_envs >= OVERLAP_MIN_ENVS)
        return make_vec_env(c.env_id, c.num_envs, seed=self.env_seed, async_=c.async_envs,
                            capture_video=c.capture_video,
                            video_dir=os.path.join(c.runs_dir, self.run_name, "videos"),
                            normalize_obs=c.normalize_obs, obs_norm_discrete=c.obs_norm_discrete,
                            normalize_reward=c.normalize_reward, gamma=c.gamma,
                            start_method=c.async_start_method, nonfinite=c.nonfinite, backend=c.env_backend,
                            env_parts=2 if halves else 1, joint_action=c.joint_action)

    def _env_parts(self) -> tuple[slice, ...] | None:
        """The row ranges the rollout steps separately (``env_overlap``, :mod:`mamba_rl.envs.parts`), or None.

        Raises:
            ValueError: ``env_overlap="on"`` where the envs cannot step in parts.
        """
        c = self.config
        parts = env_part_rows(self.envs) if c.env_overlap != "off" else None
        if c.env_overlap == "on" and parts is None:
            raise ValueError(f"PPOConfig.env_overlap 'on' needs a vector env that steps in parts (the EnvPool backend, "
                             f">= 2 envs); expected env_overlap 'auto' or 'off' here, got 'on' with env_backend "
                             f"{c.env_backend!r} and {c.num_envs} envs")
        return parts

    # --------------------------------------------------------------- rollout
    def _advance(self) -> int:
        self.progress.global_step += self.config.num_envs * self.world_size  # all ranks together
        return self.progress.global_step

    @torch.no_grad()
    def collect_rollout(self) -> tuple[list[tuple[int, float, int]], float]:
        """Fill :attr:`buffer` with ``num_steps`` steps of every env, then compute GAE
        (:func:`mamba_rl.agents.rollout.collect_rollout`).

        Returns:
            (episodes, rollout_ms): finished episodes as (global_step, return, length) and the wall
            time of the rollout in ms (the env.step share is kept in :attr:`last_env_ms`).
        """
        c = self.config
        if c.obs_norm_freeze_steps and self.global_step >= c.obs_norm_freeze_steps:
            # frozen from the first rollout at or past the step (after a resume too, before it updates)
            norm = find_vector_wrapper(self.envs, gym.wrappers.vector.NormalizeObservation)
            if norm is not None:
                norm.update_running_mean = False
        res = collect_rollout(self.envs, self.actor, self.carry, c.num_steps, c.memoryless, self.env_seed,
                              self._advance)
        self.recent_returns.extend(ret for _, ret, _ in res.episodes)
        self.last_env_ms = res.env_ms
        return res.episodes, res.rollout_ms

    # ---------------------------------------------------------------- update
    def _set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)
        if isinstance(self.head_optimizer, FlatHeadAdam):
            self.head_optimizer.set_lr(lr)
        else:
            for g in self.head_optimizer.param_groups:
                g["lr"] = lr

    def anneal_fraction(self, update: int) -> float:
        """The linear anneal's fraction at ``update`` (1-based), in [0, 1]: CleanRL's ``1 - (update - 1) /
        num_updates`` in a run that was never re-planned. :meth:`current_lr` is ``learning_rate`` times it with
        ``anneal_lr``; the update's action-set weight is ``action_set_coef`` times it with
        ``anneal_action_set``.

        The anneal is :attr:`lr_plan` (u0, f0, end): the fraction falls linearly from f0 at update u0 to 0 at
        update ``end``. :meth:`learn` sets it; when a resumed run's horizon changes (a larger
        ``total_timesteps``) it continues from the current fraction, so it never jumps, unless
        ``config.replan_lr`` re-plans from 1 over the new horizon."""
        u0, f0, end = self.lr_plan if self.lr_plan is not None else (1.0, 1.0, self.num_updates + 1.0)
        if u0 == 1.0 and f0 == 1.0:  # never re-planned: CleanRL's expression, bit for bit
            frac = 1.0 - (update - 1.0) / (end - 1.0)
        else:
            frac = f0 * (end - update) / (end - u0)
        return max(frac, 0.0)

    def current_lr(self, update: int) -> float:
        """Learning rate of ``update`` (1-based): ``learning_rate`` times :meth:`anneal_fraction` when
        ``anneal_lr`` (CleanRL's linear annealing), else ``learning_rate``."""
        c = self.config
        return self.anneal_fraction(update) * c.learning_rate if c.anneal_lr else c.learning_rate

    def _plan_lr(self) -> None:
        """Fix :attr:`lr_plan` for this learn() call's horizon (``num_updates``)."""
        end = self.num_updates + 1.0
        fresh = (1.0, 1.0, end)
        if self.lr_plan is None or self.config.replan_lr or self.update == 0:
            self.lr_plan = fresh
        elif self.lr_plan[2] != end:  # a new horizon: continue from the lr of the last update done
            u = float(self.update)
            u0, f0, old_end = self.lr_plan
            f_u = f0 * (old_end - u) / (old_end - u0)
            self.lr_plan = (u, f_u, end) if end > u else fresh

    def _draw_rows(self) -> torch.Tensor:
        c = self.config
        return shard_permutation(self.rngs.minibatch, c.num_envs, c.num_minibatches)

    def update_policy(self) -> dict[str, float]:
        """PPO epochs over :attr:`buffer` (:meth:`mamba_rl.agents.update.PPOUpdate.run`, with the current
        config and this agent's minibatch order; with ``anneal_action_set`` the action-set weight scaled by
        :meth:`anneal_fraction` of the update being done); returns the update's metrics as floats (one sync)."""
        c = self.config
        scale = self.anneal_fraction(self.update + 1) if c.anneal_action_set else 1.0
        return self.updater.run(c, self._draw_rows, set_scale=scale)

    def _nonfinite_metrics(self, metrics: dict[str, float]) -> None:
        """Add the env guard's counters (policy "zero": ``env/nonfinite_obs``, ``env/nonfinite_rewards``, values
        zeroed so far by this process's envs) and say once when an update skipped a non-finite step."""
        if self.config.nonfinite == "zero":
            guard = find_vector_wrapper(self.envs, EnvGuard)
            if guard is not None:
                metrics[NONFINITE_OBS] = float(guard.nonfinite_obs)
                metrics[NONFINITE_REWARDS] = float(guard.nonfinite_rewards)
        skipped = metrics.get(OVERFLOW_SKIPPED, 0.0)
        if skipped and self.config.dtype != "f16" and not self._warned_nonfinite and self.rank == 0:
            notice(f"warning: update {metrics.get('update')}: {skipped:.0f} minibatch step(s) had a non-finite loss or "
                   "gradient and were skipped (weights unchanged; counted in backbone/overflow_skipped)")
            self._warned_nonfinite = True

    # ----------------------------------------------------------------- learn
    @property
    def logger(self) -> TensorBoardLogger:
        """The run's TensorBoard logger (created on first use under ``runs_dir/run_name``)."""
        if self._logger is None:
            c = self.config
            # a resumed run hides what the run it resumes logged after the checkpoint (tensorboard's
            # purge_step: events at steps >= global_step + 1 of the earlier event files are purged)
            purge = self.global_step + 1 if self.global_step > 0 else None
            self._logger = TensorBoardLogger(os.path.join(c.runs_dir, self.run_name), enabled=c.track,
                                             purge_step=purge)
            hparams = c.to_dict()
            hparams.update(hparams.pop("backbone"))  # one flat table, as CleanRL's
            hparams.update(backend=f"{c.backend} (ran: {self.policy.net.backend})", device=f"{c.device} (ran: {self.device})")
            self._logger.hparams(hparams)
        return self._logger

    @property
    def checkpoint_root(self) -> Path:
        """``checkpoint_dir / run_name``: the folder of this run's checkpoints."""
        return Path(self.config.checkpoint_dir) / self.run_name

    def check_total_timesteps(self) -> None:
        """Raise ValueError when ``config.total_timesteps`` is a whole update (``batch_size * world_size`` env
        steps) or more below :attr:`global_step`: :meth:`learn` would train nothing and overwrite ``final``."""
        c = self.config
        if c.total_timesteps + c.batch_size * self.world_size <= self.global_step:
            raise ValueError(f"learn: total_timesteps {c.total_timesteps:,} is below the {self.global_step:,} env "
                             f"steps this agent has done; pass a larger total_timesteps")

    def learn(self, total_timesteps: int | None = None, progress: bool = False,
              callback: Callable[[RecurrentPPO, dict], None] | None = None) -> "RecurrentPPO":
        """Train until ``total_timesteps`` env steps (default ``config.total_timesteps``).

        Continues from :attr:`update` (so a loaded checkpoint resumes). Saves a checkpoint every
        ``checkpoint_every`` updates under ``checkpoint_dir/run_name/update_XXXXXX``, at the end
        (``final``) and on KeyboardInterrupt (``interrupted``, then re-raises; a second Ctrl-C / SIGTERM
        during that save waits for it; :attr:`interrupted_checkpoint` is the folder, None when the save
        failed), and when the env fails (:class:`mamba_rl.envs.EnvFailure`: a NaN observation or reward, a
        dead async worker, an exception from the env's step; saved as ``env_failed``, then re-raised;
        :attr:`failed_checkpoint`). Both hold the state after the last whole update (a partial rollout is
        dropped). A minibatch step whose loss or gradient is non-finite is skipped (counted in
        ``backbone/overflow_skipped``). With a larger ``total_timesteps`` than the last call, the lr
        anneal continues from its current value (see :meth:`current_lr`).

        Args:
            total_timesteps: overrides ``config.total_timesteps`` (lr annealing follows it).
            progress: show a tqdm bar with SPS and the mean of the last 100 episode returns.
            callback: called as ``callback(agent, metrics)`` after every update.

        Raises:
            ValueError: ``total_timesteps`` a whole update or more below the env steps already done
                (:attr:`global_step`), which would train nothing and overwrite ``final``.
            mamba_rl.envs.EnvFailure: the env failed (after the ``env_failed`` save).
        """
        if total_timesteps is not None and total_timesteps != self.config.total_timesteps:
            self.config = self.config.replace(total_timesteps=int(total_timesteps))
        c = self.config
        self.check_total_timesteps()
        self._num_updates = None
        self._num_updates = self.num_updates  # the lr schedule's horizon, fixed for this call
        self._plan_lr()
        self.interrupted_checkpoint = self.failed_checkpoint = self.stop_save_error = None
        lead = self.rank == 0  # rank 0 alone writes TensorBoard and checkpoints
        if lead:
            claim_run(self.run, c)  # this run's own folders, created exclusively (a resumed run keeps its own)
        logger = self.logger if lead else None
        # the bar follows global_step from a thread, so it moves during the rollout too
        planned = self.num_updates * c.batch_size * self.world_size
        bar = StepProgress(planned, self.global_step, lambda: self.global_step) if progress and lead else None
        start_time, start_step = time.perf_counter(), self.global_step
        update_start_step = self.global_step
        # the first Ctrl-C / SIGTERM interrupts, a second one (however soon) waits for the interrupted save
        signals = contextlib.ExitStack()
        signals.enter_context(interrupt_once(str(self.checkpoint_root / "interrupted")))
        try:
            while self.update < self.num_updates:
                update_start_step = self.global_step
                update = self.update + 1
                lr = self.current_lr(update)
                self._set_lr(lr)
                episodes, rollout_ms = self.collect_rollout()
                self.last_episodes = episodes
                if self.stats_sync is not None:  # one all-reduce: every rank normalises with the same statistics
                    self.stats_sync.sync(self.dp)
                t0 = time.perf_counter()
                metrics = self.update_policy()
                update_ms = (time.perf_counter() - t0) * 1e3
                self.update = update
                sps = (self.global_step - start_step) / self.world_size / max(time.perf_counter() - start_time, 1e-9)
                if self.dp is not None:  # once per update: every rank's episodes, SPS summed over ranks
                    local = len(episodes)
                    episodes, sps = self.dp.gather_episodes(episodes, sps)
                    self.recent_returns.extend(ret for _, ret, _ in episodes[local:])
                metrics.update({SPS: sps, LEARNING_RATE: lr, ROLLOUT_MS: rollout_ms, UPDATE_MS: update_ms,
                                "global_step": self.global_step, "update": update})
                self._nonfinite_metrics(metrics)
                self.history.append(metrics)
                if logger is not None:
                    logger.episodes(episodes)
                    logger.scalars({k: v for k, v in metrics.items()
                                    if "/" in k and not k.startswith("debug/")}, self.global_step)
                if bar is not None:
                    recent = np.mean(self.recent_returns) if self.recent_returns else float("nan")
                    bar.sync(SPS=f"{sps:.0f}", ret=f"{recent:.1f}")
                if callback is not None:
                    callback(self, metrics)
                if lead and c.checkpoint_every and update % c.checkpoint_every == 0 and update < self.num_updates:
                    self.save(self.checkpoint_root / f"update_{update:06d}")
        except (KeyboardInterrupt, EnvFailure) as stop:
            if self.global_step != update_start_step and self.update < update:
                # stopped inside an update: its partial rollout is dropped, so the counters (and a
                # resume) say what was trained on: `update` whole updates of batch_size steps
                self.global_step = update_start_step
            if lead:
                name = "interrupted" if isinstance(stop, KeyboardInterrupt) else "env_failed"
                target = self.checkpoint_root / name
                with deferred_signals(str(target)):  # a second Ctrl-C / SIGTERM waits for the save
                    try:
                        saved = self.save(target)
                    except Exception as err:  # noqa: BLE001 - say so, and still end as stopped
                        self.stop_save_error = f"{type(err).__name__}: {err}"
                        notice(f"the {name} checkpoint was not saved: {self.stop_save_error}")
                    else:
                        if name == "interrupted":
                            self.interrupted_checkpoint = saved
                        else:
                            self.failed_checkpoint = saved
            raise
        finally:
            if bar is not None:
                bar.close()
            if logger is not None:
                logger.flush()
            signals.close()
        if lead:
            self.save(self.checkpoint_root / "final")
        return self

    # ------------------------------------------------------ acting (delegated)
    def initial_policy_state(self, batch: int) -> PolicyState:
        """Zero recurrent state and previous action/reward for ``batch`` envs."""
        return self.policy.initial_state(batch)

    def predict(self, obs: np.ndarray, state: PolicyState | None = None, episode_start: np.ndarray | None = None,
                deterministic: bool = False, reward: np.ndarray | None = None) -> tuple[np.ndarray, PolicyState]:
        """sb3-style ``predict``: (env actions, new PolicyState) of :meth:`Policy.act` (see its arguments).
        ``obs``: the observations as ``gymnasium.make(env_id)`` returns them, raw: flat float rows [B, obs_dim] /
        [obs_dim], or observations of the env's space (a Dict / Tuple observation, a batch of them as its vector
        env returns, or a list of them), flattened as in training (:func:`mamba_rl.envs.flatten_observation`);
        anything else raises ValueError naming the space. The agent's own observation normalisation
        (``normalize_obs``) is applied with the training statistics frozen, as :meth:`evaluate` does, so a plain
        env loop acts as the trained policy does. ``reward`` (the last raw reward, [B]) is needed with
        ``prev_reward`` (on by default) wherever a row does not start an episode, and is scaled as training's
        NormalizeReward scaled it; a missing, NaN / inf or non-numeric one is a ValueError. Samples with a
        generator of its own (seeded with ``config.seed`` on first use), never the rollout's, so predicting never
        changes training."""
        if self._predict_generator is None:
            self._predict_generator = torch.Generator().manual_seed(self.config.seed)
        obs, reward = self._as_trained(obs, reward, "predict")
        action, state, _ = self.policy.act(obs, state, episode_start, deterministic, reward, self._predict_generator)
        return action, state

    def _as_trained(self, obs: Any, reward: Any, who: str) -> tuple[Any, Any]:
        """Raw observations and reward as the policy saw them in training: flattened and normalised with the
        frozen statistics, the reward scaled (:func:`obs_normaliser`, :func:`reward_scale_of`); without
        ``prev_reward`` the reward is not an input and is ignored. A reward that is not numbers is a ValueError
        naming ``who`` (its shape and finiteness: :meth:`Policy.act`)."""
        obs = self._flat_obs(obs)
        if obs.ndim in (1, 2) and obs.shape[-1] == self.policy.obs_dim and np.issubdtype(obs.dtype, np.number) \
                and not np.issubdtype(obs.dtype, np.complexfloating):  # anything else: Policy.act's clear error
            obs = obs_normaliser(self.envs)(obs)
        if reward is None or not self.policy.use_prev_reward:
            return obs, None
        try:
            raw = np.asarray(reward)
        except ValueError as err:  # numpy's "inhomogeneous shape"
            raise ValueError(f"{who}: reward must be one number per env, got {reward!r}: {err}") from None
        if raw.dtype.kind not in "biuf":
            raise ValueError(f"{who}: reward must be numbers, got dtype {raw.dtype}: {reward!r}")
        return obs, raw.astype(np.float64) * reward_scale_of(self.envs)

    def raw_observation_space(self) -> gym.Space:
        """The single env's observation space before flattening (what ``env.reset()`` returns samples of)."""
        if self._raw_obs_space is None:  # async workers: one env of the id is built here
            self._raw_obs_space = raw_observation_space(self.envs, self.config.env_id)
        return self._raw_obs_space

    def _flat_obs(self, obs: Any) -> Any:
        """``obs`` as a float array [B, obs_dim] / [obs_dim]: raw Dict / Tuple observations are flattened as
        in training (:func:`mamba_rl.envs.flatten_observation`); anything that is not numeric raises a
        ValueError naming the observation space."""
        if isinstance(obs, (dict, tuple)) or (isinstance(obs, list) and obs and isinstance(obs[0], (dict, tuple))):
            return flatten_observation(self.raw_observation_space(), obs, self.policy.obs_dim)
        try:
            arr = np.asarray(obs)
        except ValueError as err:  # numpy's "inhomogeneous shape"
            raise ValueError(f"predict: expected a float array [B, {self.policy.obs_dim}] or an observation of the env's "
                             f"space {self.raw_observation_space()}, got {type(obs).__name__}: {err}") from None
        if arr.dtype == object:
            raise ValueError(f"predict: expected a float array [B, {self.policy.obs_dim}] or an observation of the env's "
                             f"space {self.raw_observation_space()}, got an object array of shape {arr.shape}")
        return arr

    def value(self, obs: np.ndarray, state: PolicyState, episode_start: np.ndarray,
              reward: np.ndarray | None = None) -> np.ndarray:
        """Critic value V(obs) [B] float32 (numpy) with ``state`` (the state is not advanced): ``obs`` and
        ``reward`` raw, as in :meth:`predict` (normalised and scaled as in training), ``state`` the PolicyState of
        B envs it returned, ``episode_start`` [B] bools, ``reward`` [B] (needed with ``prev_reward`` as in
        :meth:`predict`). Raises ValueError
        for any of them of another shape or type, or a NaN / inf observation
        (:meth:`mamba_rl.agents.policy.Policy.value`)."""
        obs, reward = self._as_trained(obs, reward, "value")
        return self.policy.value(obs, state, episode_start, reward)

    def evaluate(self, num_episodes: int = 10, deterministic: bool = False, seed: int | None = None,
                 video_dir: str | None = None, progress: bool = False) -> EvalResult:
        """:func:`~mamba_rl.agents.evaluate.evaluate_policy` on ``config.env_id`` with this agent's
        policy and frozen training normalisation; episode k resets the env with seed ``seed + k``
        (default seed: config.seed + 10_000). Actions are sampled from a fresh generator seeded with
        ``config.seed`` (never the rollout's), so evaluating never changes training and the same call
        gives the same result. ``progress``: a tqdm bar over the episodes.
        Raises ValueError if num_episodes is not an int >= 1, or the seeds leave gymnasium's [0, 2**32 - 1]."""
        c = self.config
        return evaluate_policy(self.policy, c.env_id, num_episodes, deterministic,
                               seed=c.seed + 10_000 if seed is None else seed, video_dir=video_dir,
                               train_envs=self.envs, generator=torch.Generator().manual_seed(c.seed),
                               progress=progress, joint_action=c.joint_action)

    # ----------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> Path:
        """Save everything needed to resume or evaluate into the folder ``path`` (returned as a Path):
        ``agent.safetensors`` (safetensors + JSON) and ``envs.pkl`` (the envs mid-episode, read only on
        request); see :mod:`mamba_rl.agents.checkpoint`. The folder is replaced as a whole, so a failed or
        killed save leaves a previous checkpoint there intact.

        Raises:
            mamba_rl.agents.checkpoint.NonFiniteWeightsError: weights or optimizer moments hold NaN / inf
                (nothing is written)."""
        path, err = save_agent(path, config=self.config, run=self.run, progress=self.progress, policy=self.policy,
                               trainer=self.trainer, head_optimizer=self.head_optimizer, rngs=self.rngs,
                               stepper=self.stepper, carry=self.carry, envs=self.envs, world_size=self.world_size)
        if err is not None and not self._warned_pickle:  # once per agent, outside the progress bar
            notice(f"note: the envs could not be pickled ({err}); resuming from this run's checkpoints "
                   "restores the learner exactly but resets the envs")
            self._warned_pickle = True
        return path

    checkpoint_file = staticmethod(checkpoint_file)

    @classmethod
    def load(cls, path: str | Path, env: str | gym.vector.VectorEnv | None = None,
             restore_envs: bool = False, **overrides: Any) -> RecurrentPPO:
        """Rebuild an agent from a :meth:`save` folder, ready to ``learn`` on (resume) or evaluate.

        Args:
            path: checkpoint folder (or its ``agent.safetensors``).
            env: replace the env (then the carried env state is not restored).
            restore_envs: unpickle ``envs.pkl`` when present, so training continues the exact
                trajectories (trusted checkpoints only); otherwise the envs are rebuilt and reset.
            **overrides: PPOConfig fields to change (e.g. ``device``, ``total_timesteps``).

        Raises:
            FileNotFoundError: no checkpoint there. ValueError / mamba_rl.CheckpointError:
            not a RecurrentPPO checkpoint, or one that does not fit; ``restore_envs`` without an
            ``envs.pkl`` beside it (single process, no ``env`` given), or with one holding another number of
            envs than ``num_envs``.
        """
        ckpt, extra = read_agent_meta(path)
        config = agent_config(extra, **overrides)
        saved_joint = bool(extra.get("ppo_config", {}).get("joint_action", False))
        if config.joint_action != saved_joint:  # the policy's actions mean other things (even at the same width)
            raise CheckpointError(f"checkpoint {ckpt} was saved with joint_action {saved_joint} (its policy acts in "
                                  f"{'the joint' if saved_joint else 'the per-component'} action space), but the "
                                  f"config to load it into has joint_action {config.joint_action}; resume with "
                                  f"{'--joint-action' if saved_joint else '--no-joint-action'}")
        env_file = ckpt.parent / "envs.pkl"
        # data-parallel: every rank loads the same weights, optimizer state and counters (any world size);
        # the per-rank env carry and sampling RNGs are re-created, never restored
        if restore_envs and env is None and dist_world_size() == 1 and not env_file.exists():
            why = ("its save could not pickle the envs" if extra.get("envs_pkl_sha256", "") is None
                   else "the file is missing")
            raise CheckpointError(f"restore_envs (--resume-envs): no envs.pkl beside {ckpt} ({why}), so the envs "
                                  f"cannot be restored mid-episode; load without it to rebuild and reset them")
        restore = restore_envs and env is None and env_file.exists() and dist_world_size() == 1
        if restore:
            check_envs_file(ckpt, env_file)  # a folder mixing two saves is refused before anything is unpickled
            envs = load_envs(env_file)
            if envs.num_envs != config.num_envs:
                envs.close()
                raise CheckpointError(f"restore_envs (--resume-envs): the checkpoint's envs.pkl holds {envs.num_envs} "
                                      f"envs but num_envs (--num-envs) is {config.num_envs}; resume with "
                                      f"--num-envs {envs.num_envs}, or without --resume-envs to rebuild the envs")
            agent = cls(envs, config=config)
        else:
            agent = cls(env if env is not None else config.env_id, config=config)
        norm = gym.wrappers.vector.NormalizeObservation
        if (not restore and env is None and extra.get("obs_rms") is not None
                and find_vector_wrapper(agent.envs, norm) is None):
            # saved with observation statistics that the rebuilt stack has no normaliser for: a run on
            # all-discrete observations from before make_vec_env stopped normalising them (2026-12-04). Its policy
            # was trained on normalised inputs, so the resumed run keeps the normaliser (statistics restored below)
            agent.envs = VecNormalizeObservation(agent.envs)  # a PartedStep: the halves still step in parts
            if agent.stats_sync is not None:
                agent.stats_sync = RunningStatsSync(agent.envs)
        try:
            restore_agent(ckpt, run=agent.run, progress=agent.progress, policy=agent.policy, trainer=agent.trainer,
                          head_optimizer=agent.head_optimizer, rngs=agent.rngs, stepper=agent.stepper,
                          carry=agent.carry, envs=agent.envs, restore_carry=restore)
            if agent.stats_sync is not None:
                agent.stats_sync.rebase()  # the restored statistics, equal on every rank, are the new base
            if agent.dp is not None:
                agent.rngs.sample.manual_seed(config.seed + 1000 * agent.update + agent.rank)
                agent._sync_ranks()
        except BaseException:
            agent.close()  # a checkpoint that does not fit: do not leak the envs just built
            raise
        return agent

    def close(self) -> None:
        """Close the envs and the TensorBoard writer."""
        self.envs.close()
        if self._logger is not None:
            self._logger.close()
