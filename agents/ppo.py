"""Recurrent PPO (Schulman et al. 2017) whose memory is the Mamba backbone and its fused trainer.

Loop (ARCHITECTURE.md section 6), per update:

1. Rollout: the stepper (graph-captured on CUDA) acts for ``num_steps`` steps in ``num_envs``
   gymnasium envs. Its state at the rollout start is stored as the update's initial state; it
   carries across rollouts and is reset only per env at episode starts, inside the kernel.
   Per step the device does one host->device copy, the stepper and one fused head GEMM; the
   head outputs come back in one copy and sampling / log-probs / storage run on the host
   (the env needs the action on the host anyway), so no per-step small-kernel storm.
2. Advantages: GAE under NextStep autoreset (:func:`mamba_rl.agents.gae.compute_gae`): the reset
   step after a done is never a transition; a truncation bootstraps with V(final obs) computed
   with the pre-reset state.
3. Update: ``update_epochs`` x ``num_minibatches`` minibatches, each a fixed-shape slice over envs
   ``[num_envs / num_minibatches, num_steps]`` with its stored initial state and episode_starts.
   ``trainer.forward`` gives features; the torch heads and the PPO loss give d_temporal through
   autograd; ``trainer.backward_step(d_temporal, extra_grad_sq=|head grads|^2)`` clips one global
   norm over heads + backbone and steps AdamW; the head Adam steps with the same clip factor.

Defaults and TensorBoard tags follow CleanRL (Huang et al. 2022). Device and dtype come from
:class:`PPOConfig`; the same code runs on CPU (reference backend) and CUDA (graph-captured).
"""

from __future__ import annotations

import os
import pickle
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from mamba_rl import MambaBackbone, MambaConfig, RecurrentState
from mamba_rl.envs import find_vector_wrapper, make_env, make_vec_env, needs_flatten

from .config import PPOConfig
from .gae import compute_gae
from .heads import ActorHead, CriticHead, action_dim, action_input_dim, encode_prev_action
from .logger import TensorBoardLogger
from .rollout import RolloutBuffer

__all__ = ["RecurrentPPO", "PolicyState", "EvalResult", "resolve_device", "run_name_for"]

CHECKPOINT_FORMAT = "mamba_rl.agents.RecurrentPPO/1"


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available else cpu; "cuda" without CUDA raises RuntimeError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but torch.cuda.is_available() is False")
    return dev


def run_name_for(config: PPOConfig, unix_time: Optional[int] = None) -> str:
    """CleanRL's run name ``{env}__{exp_name}__{seed}__{unix_time}`` ('/' in ids becomes '_')."""
    t = int(time.time()) if unix_time is None else int(unix_time)
    return f"{config.env_id.replace('/', '_')}__{config.exp_name}__{config.seed}__{t}"


@dataclass
class PolicyState:
    """What :meth:`RecurrentPPO.predict` carries between calls for a batch of B envs.

    Attributes:
        recurrent: backbone RecurrentState (conv [L,B,d_inner,d_conv-1], ssm [L,B,d_inner,d_state]).
        prev_action: [B, action_dim] last action returned (int64 or float32).
        prev_reward: [B] float32 last reward passed in.
    """

    recurrent: RecurrentState
    prev_action: torch.Tensor
    prev_reward: torch.Tensor


@dataclass
class EvalResult:
    """Outcome of :meth:`RecurrentPPO.evaluate`.

    Attributes:
        returns: [episodes] float64 undiscounted returns. lengths: [episodes] int64 steps.
        values: per episode, the [length] float32 critic values along the episode.
    """

    returns: np.ndarray
    lengths: np.ndarray
    values: list

    @property
    def mean(self) -> float:
        return float(np.mean(self.returns))

    @property
    def std(self) -> float:
        return float(np.std(self.returns))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / count


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

    Raises:
        ValueError: bad config, or a vector env whose sub-env count or autoreset mode differs.
        TypeError: an unsupported action space.
    """

    def __init__(self, env: Union[str, gym.vector.VectorEnv, None] = None, config: Optional[PPOConfig] = None,
                 **overrides: Any):
        config = config if config is not None else PPOConfig()
        if isinstance(env, str):
            overrides["env_id"] = env
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        self.device = resolve_device(config.device)
        self.run_name = run_name_for(config)
        self._logger: Optional[TensorBoardLogger] = None

        if env is None or isinstance(env, str):
            self.envs = self._make_envs()
        else:
            self.envs = self._adopt_envs(env)
        obs_space = self.envs.single_observation_space
        self.obs_dim = int(np.prod(obs_space.shape))
        self.action_space = self.envs.single_action_space
        self.action_dim = action_dim(self.action_space)
        self.discrete_actions = not isinstance(self.action_space, spaces.Box)
        self.input_dim = self.obs_dim
        if config.prev_action:
            self.input_dim += action_input_dim(self.action_space)
        if config.prev_reward:
            self.input_dim += 1

        torch.manual_seed(config.seed)
        init_gen = torch.Generator().manual_seed(config.seed)
        self.mamba_config = MambaConfig(d_model=config.d_model, n_layers=config.n_layers, d_state=config.d_state,
                                        d_conv=config.d_conv, expand=config.expand)
        self.net = MambaBackbone(self.mamba_config, self.input_dim, device=self.device, seed=config.seed,
                                 backend=config.backend)
        self.heads = nn.ModuleDict({
            "actor": ActorHead(config.d_model, self.action_space, init_gen),
            "critic": CriticHead(config.d_model, init_gen),
        }).to(self.device)
        self.head_optimizer = torch.optim.Adam(self.heads.parameters(), lr=config.learning_rate,
                                               eps=config.adam_eps)
        from mamba_rl import MambaTrainer

        self.trainer = MambaTrainer(self.net, batch=config.envs_per_minibatch, seq_len=config.num_steps,
                                    dtype=config.dtype, lr=config.learning_rate, betas=(0.9, 0.999),
                                    eps=config.adam_eps, weight_decay=config.weight_decay,
                                    no_decay="reference", max_grad_norm=config.max_grad_norm)
        self.stepper = self.net.stepper(batch=config.num_envs)
        self._graphs = config.cuda_graphs and self.device.type == "cuda"
        if self._graphs:
            self.stepper.capture_graph()
            self.trainer.capture_graph()
        self._predict_steppers: dict[int, Any] = {}
        self._warned_pickle = False

        # actions are sampled on the CPU (see collect_rollout), with this generator
        self.sample_generator = torch.Generator().manual_seed(config.seed)
        self.np_rng = np.random.default_rng(config.seed)
        self.buffer = RolloutBuffer(config.num_envs, config.num_steps, self.input_dim, self.obs_dim,
                                    self.action_dim, self.discrete_actions, self.stepper.state, self.device,
                                    storage_device=torch.device("cpu"))
        # carried between rollouts (CPU: the per-step policy math runs on the host, see collect_rollout)
        n = config.num_envs
        self.next_obs = torch.zeros(n, self.obs_dim)
        self.next_start = torch.ones(n, dtype=torch.bool)
        self.next_done = torch.zeros(n, dtype=torch.bool)
        self.prev_action = torch.zeros(n, self.action_dim,
                                       dtype=torch.int64 if self.discrete_actions else torch.float32)
        self.prev_reward = torch.zeros(n)
        self._env_started = False
        # host staging of [backbone input | episode_start] for one host->device copy per step
        self._stage = torch.zeros(n, self.input_dim + 1, dtype=torch.float32,
                                  pin_memory=self.device.type == "cuda")
        self.global_step = 0
        self.update = 0
        self.history: list[dict[str, float]] = []
        self.recent_returns: deque = deque(maxlen=100)
        self.last_episodes: list[tuple[int, float, int]] = []  # (global_step, return, length) of the last rollout
        self._act_low = self._act_high = None
        if isinstance(self.action_space, spaces.Box):
            self._act_low = torch.as_tensor(self.action_space.low.reshape(-1), dtype=torch.float32)
            self._act_high = torch.as_tensor(self.action_space.high.reshape(-1), dtype=torch.float32)

    # ------------------------------------------------------------------ envs
    def _make_envs(self, capture_video: Optional[bool] = None) -> gym.vector.VectorEnv:
        c = self.config
        video = c.capture_video if capture_video is None else capture_video
        return make_vec_env(c.env_id, c.num_envs, seed=c.seed, async_=c.async_envs, capture_video=video,
                            video_dir=os.path.join(c.runs_dir, self.run_name, "videos"),
                            normalize_obs=c.normalize_obs, normalize_reward=c.normalize_reward, gamma=c.gamma)

    def _adopt_envs(self, envs: gym.vector.VectorEnv) -> gym.vector.VectorEnv:
        if not isinstance(envs, gym.vector.VectorEnv):
            raise ValueError(f"env must be an env id or a gymnasium.vector.VectorEnv, got {type(envs).__name__}")
        if envs.num_envs != self.config.num_envs:
            raise ValueError(f"the vector env has {envs.num_envs} sub-envs but config.num_envs is "
                             f"{self.config.num_envs}; pass num_envs={envs.num_envs}")
        mode = envs.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if mode != gym.vector.AutoresetMode.NEXT_STEP:
            raise ValueError(f"RecurrentPPO needs NextStep autoreset (gymnasium's default), got {mode}")
        if needs_flatten(envs.single_observation_space):
            if not (isinstance(envs.single_observation_space, spaces.Box)
                    and len(envs.single_observation_space.shape) == 1):
                envs = gym.wrappers.vector.FlattenObservation(envs)
            envs = gym.wrappers.vector.DtypeObservation(envs, np.float32)
        return envs

    def _reset_envs(self) -> None:
        obs, _ = self.envs.reset(seed=self.config.seed)
        n = self.config.num_envs
        self.next_obs = torch.as_tensor(np.asarray(obs, dtype=np.float32).reshape(n, self.obs_dim))
        self.next_start = torch.ones(n, dtype=torch.bool)
        self.next_done = torch.zeros(n, dtype=torch.bool)
        self.prev_action = torch.zeros_like(self.prev_action)
        self.prev_reward = torch.zeros_like(self.prev_reward)
        self.stepper.reset()
        self._env_started = True

    # ---------------------------------------------------------------- inputs
    def build_input(self, obs: torch.Tensor, prev_action: torch.Tensor, prev_reward: torch.Tensor,
                    episode_starts: torch.Tensor) -> torch.Tensor:
        """Backbone input [B, input_dim] f32 from obs [B, obs_dim], prev_action [B, action_dim],
        prev_reward [B] and episode_starts [B] bool (previous action/reward are zero at starts)."""
        parts = [obs.float()]
        keep = (~episode_starts).float().unsqueeze(-1)
        if self.config.prev_action:
            parts.append(encode_prev_action(self.action_space, prev_action) * keep)
        if self.config.prev_reward:
            parts.append(prev_reward.float().unsqueeze(-1) * keep)
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def _to_env_action(self, action: torch.Tensor) -> np.ndarray:
        space = self.action_space
        if isinstance(space, spaces.Discrete):
            return (action[:, 0] + int(space.start)).cpu().numpy()
        if isinstance(space, spaces.MultiDiscrete):
            return (action + torch.as_tensor(space.start, device=action.device)).cpu().numpy()
        a = torch.maximum(torch.minimum(action, self._act_high), self._act_low)
        return a.cpu().numpy().astype(space.dtype).reshape((action.shape[0],) + space.shape)

    # --------------------------------------------------------------- rollout
    @torch.no_grad()
    def collect_rollout(self) -> tuple[list[tuple[int, float, int]], float]:
        """Fill :attr:`buffer` with ``num_steps`` steps of every env, then compute GAE.

        Returns:
            (episodes, rollout_ms): finished episodes as (global_step, return, length) and the wall
            time of the rollout in ms.
        """
        c, buf = self.config, self.buffer
        if not self._env_started:
            self._reset_envs()
        t0 = time.perf_counter()
        episodes: list[tuple[int, float, int]] = []
        actor, critic = self.heads["actor"], self.heads["critic"]
        buf.initial_state.copy_(self.stepper.state)
        # Per step, the device runs only: one host->device copy of [input | start], the stepper
        # (a CUDA graph replay on GPU) and one GEMM for both heads; the head outputs come back in
        # one device->host copy and sampling, log-probs and storage happen on the host. The head
        # weights do not change during a rollout, so they are fused once here.
        with torch.no_grad():
            w = torch.cat([actor.linear.weight, critic.linear.weight]).t().contiguous()
            bias = torch.cat([actor.linear.bias, critic.linear.bias])
            log_std = actor.log_std.detach().cpu() if actor.kind == "gaussian" else None
        p_dim = actor.out_dim

        def act(x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
            self._stage[:, : self.input_dim] = x
            self._stage[:, self.input_dim] = start
            dev = self._stage.to(self.device, non_blocking=True)
            x_dev = dev[:, : self.input_dim]
            if not self._graphs:  # a captured stepper copies into its own buffer; eager kernels get contiguous rows
                x_dev = x_dev.contiguous()
            feat = self.stepper.step(x_dev, episode_starts=dev[:, self.input_dim] > 0.5)
            return torch.addmm(bias, feat, w).cpu()  # [N, p_dim + 1]: actor raw outputs | value

        for t in range(c.num_steps):
            start = self.next_start | c.memoryless
            x = self.build_input(self.next_obs, self.prev_action, self.prev_reward, start)
            out = act(x, start)
            dist = actor.dist(out[:, :p_dim], log_std)
            action = dist.sample(self.sample_generator)
            buf.inputs[:, t] = x
            buf.episode_starts[:, t] = start
            buf.valid[:, t] = ~self.next_done
            buf.values[:, t] = out[:, p_dim]
            buf.actions[:, t] = action
            buf.logprobs[:, t] = dist.log_prob(action)
            obs, reward, term, trunc, info = self.envs.step(self._to_env_action(action))
            self.global_step += c.num_envs
            reward_t = torch.as_tensor(np.asarray(reward, dtype=np.float32))
            term_t = torch.as_tensor(np.asarray(term, dtype=bool))
            trunc_t = torch.as_tensor(np.asarray(trunc, dtype=bool))
            buf.rewards[:, t] = reward_t
            buf.terminations[:, t] = term_t
            buf.truncations[:, t] = trunc_t
            # the obs after a reset step is the first obs of the next episode
            self.next_start = self.next_done
            self.next_done = term_t | trunc_t
            self.prev_action = action
            self.prev_reward = reward_t
            self.next_obs = torch.as_tensor(np.asarray(obs, dtype=np.float32).reshape(c.num_envs, self.obs_dim))
            if "_episode" in info:
                mask = np.asarray(info["_episode"])
                for i in np.nonzero(mask)[0]:
                    ret, length = float(info["episode"]["r"][i]), int(info["episode"]["l"][i])
                    episodes.append((self.global_step, ret, length))
                    self.recent_returns.append(ret)
        # V(next obs) with the carried state, without advancing it (exact V(final obs) after a done)
        saved = self.stepper.get_state()
        start = self.next_start | c.memoryless
        next_value = act(self.build_input(self.next_obs, self.prev_action, self.prev_reward, start), start)[:, p_dim]
        self.stepper.load_state(saved)
        buf.advantages, buf.returns = compute_gae(buf.rewards, buf.values, buf.terminations, buf.truncations,
                                                  buf.valid, next_value.clone(), c.gamma, c.gae_lambda)
        return episodes, (time.perf_counter() - t0) * 1e3

    # ---------------------------------------------------------------- update
    def _set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)
        for g in self.head_optimizer.param_groups:
            g["lr"] = lr

    def current_lr(self, update: int) -> float:
        """Learning rate of ``update`` (1-based): CleanRL's linear annealing when ``anneal_lr``."""
        c = self.config
        if not c.anneal_lr:
            return c.learning_rate
        frac = 1.0 - (update - 1.0) / c.num_updates
        return frac * c.learning_rate

    def minibatch_rows(self) -> list[torch.Tensor]:
        """One epoch's minibatches: a permutation of the envs cut into ``num_minibatches`` equal
        LongTensors of ``envs_per_minibatch`` rows each (fixed shape)."""
        c = self.config
        perm = torch.as_tensor(self.np_rng.permutation(c.num_envs), device=self.device)
        return list(perm.view(c.num_minibatches, c.envs_per_minibatch))

    def update_policy(self) -> dict[str, float]:
        """PPO epochs over :attr:`buffer`; returns the update's metrics as floats (one sync)."""
        c = self.config
        init_state = self.buffer.initial_state
        buf = SimpleNamespace(**self.buffer.to_device(self.device))  # the rollout, moved once per update
        actor, critic = self.heads["actor"], self.heads["critic"]
        head_params = [p for p in self.heads.parameters()]
        clipfracs, grad_norms, overflows = [], [], []
        last: dict[str, torch.Tensor] = {}
        parity = None
        loss_scale = None
        for epoch in range(c.update_epochs):
            for k, rows in enumerate(self.minibatch_rows()):
                starts = buf.episode_starts[rows]
                y = self.trainer.forward(buf.inputs[rows], initial_state=init_state.index(rows),
                                         episode_starts=starts)
                y = y.detach().float().requires_grad_()
                dist = actor(y)
                newvalue = critic(y)
                mb_actions = buf.actions[rows]
                newlogprob = dist.log_prob(mb_actions)
                entropy = dist.entropy()
                mask = buf.valid[rows].float()
                count = mask.sum().clamp_min(1.0)
                logratio = newlogprob - buf.logprobs[rows]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = _masked_mean(-logratio, mask, count)
                    approx_kl = _masked_mean((ratio - 1) - logratio, mask, count)
                    clipfracs.append(_masked_mean(((ratio - 1.0).abs() > c.clip_coef).float(), mask, count))
                    if epoch == 0 and k == 0:
                        parity = torch.maximum(((newlogprob - buf.logprobs[rows]).abs() * mask).max(),
                                               ((newvalue - buf.values[rows]).abs() * mask).max())
                mb_adv = buf.advantages[rows]
                if c.norm_adv:
                    mean = _masked_mean(mb_adv, mask, count)
                    var = ((mb_adv - mean).pow(2) * mask).sum() / (count - 1).clamp_min(1.0)
                    mb_adv = (mb_adv - mean) / (var.sqrt() + 1e-8)
                pg_loss = _masked_mean(torch.max(-mb_adv * ratio,
                                                 -mb_adv * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef)), mask, count)
                mb_returns, mb_values = buf.returns[rows], buf.values[rows]
                if c.clip_vloss:
                    v_unclipped = (newvalue - mb_returns).pow(2)
                    v_clipped = mb_values + (newvalue - mb_values).clamp(-c.clip_coef, c.clip_coef)
                    v_loss = 0.5 * _masked_mean(torch.max(v_unclipped, (v_clipped - mb_returns).pow(2)), mask, count)
                else:
                    v_loss = 0.5 * _masked_mean((newvalue - mb_returns).pow(2), mask, count)
                entropy_loss = _masked_mean(entropy, mask, count)
                loss = pg_loss - c.ent_coef * entropy_loss + v_loss * c.vf_coef

                self.head_optimizer.zero_grad(set_to_none=False)
                loss.backward()
                head_grad_sq = torch.stack([p.grad.pow(2).sum() for p in head_params]).sum()
                m = self.trainer.backward_step(d_temporal=y.grad, extra_grad_sq=head_grad_sq)
                if c.max_grad_norm is not None:
                    coef = m.clip_coef
                    for p in head_params:
                        p.grad.mul_(coef)
                self.head_optimizer.step()
                grad_norms.append(m.grad_norm.float().reshape(()))
                overflows.append(m.overflow_skipped.float().reshape(()))
                loss_scale = m.loss_scale
                last = dict(pg=pg_loss.detach(), v=v_loss.detach(), ent=entropy_loss.detach(),
                            kl=approx_kl, old_kl=old_approx_kl)
            if c.target_kl is not None and float(last["kl"]) > c.target_kl:
                break
        with torch.no_grad():
            mask = buf.valid.float()
            count = mask.sum().clamp_min(1.0)
            y_true, y_pred = buf.returns, buf.values
            var_y = _masked_mean((y_true - _masked_mean(y_true, mask, count)).pow(2), mask, count)
            diff = y_true - y_pred
            var_d = _masked_mean((diff - _masked_mean(diff, mask, count)).pow(2), mask, count)
            explained_var = torch.where(var_y == 0, torch.full_like(var_y, float("nan")), 1 - var_d / var_y)
        names = ["losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/approx_kl",
                 "losses/old_approx_kl", "losses/clipfrac", "losses/explained_variance",
                 "backbone/grad_norm", "backbone/loss_scale", "backbone/overflow_skipped", "debug/rollout_parity"]
        vec = torch.stack([
            last["v"], last["pg"], last["ent"], last["kl"], last["old_kl"], torch.stack(clipfracs).mean(),
            explained_var, torch.stack(grad_norms).mean(),
            torch.as_tensor(loss_scale, device=self.device).float().reshape(()),
            torch.stack(overflows).sum(), parity if parity is not None else torch.zeros((), device=self.device),
        ]).float().cpu().tolist()  # the one device->host sync of the update
        return dict(zip(names, vec))

    # ----------------------------------------------------------------- learn
    @property
    def logger(self) -> TensorBoardLogger:
        """The run's TensorBoard logger (created on first use under ``runs_dir/run_name``)."""
        if self._logger is None:
            c = self.config
            self._logger = TensorBoardLogger(os.path.join(c.runs_dir, self.run_name), enabled=c.track)
            self._logger.hparams(c.to_dict())
        return self._logger

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.config.checkpoint_dir) / self.run_name

    def learn(self, total_timesteps: Optional[int] = None, progress: bool = False,
              callback: Optional[Callable[["RecurrentPPO", dict], None]] = None) -> "RecurrentPPO":
        """Train until ``total_timesteps`` env steps (default ``config.total_timesteps``).

        Continues from :attr:`update` (so a loaded checkpoint resumes). Saves a checkpoint every
        ``checkpoint_every`` updates under ``checkpoint_dir/run_name/update_XXXXXX``, at the end
        (``final``) and on KeyboardInterrupt (``interrupted``, then re-raises).

        Args:
            total_timesteps: overrides ``config.total_timesteps`` (lr annealing follows it).
            progress: show a tqdm bar with SPS and the mean of the last 100 episode returns.
            callback: called as ``callback(agent, metrics)`` after every update.
        """
        if total_timesteps is not None and total_timesteps != self.config.total_timesteps:
            self.config = self.config.replace(total_timesteps=int(total_timesteps))
        c = self.config
        logger = self.logger
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=c.num_updates * c.batch_size, initial=self.global_step, unit="step",
                       dynamic_ncols=True)
        start_time, start_step = time.perf_counter(), self.global_step
        try:
            while self.update < c.num_updates:
                update = self.update + 1
                lr = self.current_lr(update)
                self._set_lr(lr)
                episodes, rollout_ms = self.collect_rollout()
                self.last_episodes = episodes
                t0 = time.perf_counter()
                metrics = self.update_policy()
                update_ms = (time.perf_counter() - t0) * 1e3
                self.update = update
                sps = (self.global_step - start_step) / max(time.perf_counter() - start_time, 1e-9)
                metrics.update({"charts/SPS": sps, "charts/learning_rate": lr, "perf/rollout_ms": rollout_ms,
                                "perf/update_ms": update_ms, "global_step": self.global_step, "update": update})
                self.history.append(metrics)
                logger.episodes(episodes)
                logger.scalars({k: v for k, v in metrics.items()
                                if "/" in k and not k.startswith("debug/")}, self.global_step)
                if bar is not None:
                    bar.update(c.batch_size)
                    recent = np.mean(self.recent_returns) if self.recent_returns else float("nan")
                    bar.set_postfix(SPS=f"{sps:.0f}", ret=f"{recent:.1f}", refresh=False)
                if callback is not None:
                    callback(self, metrics)
                if c.checkpoint_every and update % c.checkpoint_every == 0 and update < c.num_updates:
                    self.save(self.checkpoint_root / f"update_{update:06d}")
        except KeyboardInterrupt:
            self.save(self.checkpoint_root / "interrupted")
            raise
        finally:
            if bar is not None:
                bar.close()
            logger.flush()
        self.save(self.checkpoint_root / "final")
        return self

    # --------------------------------------------------------------- predict
    def initial_policy_state(self, batch: int) -> PolicyState:
        """Zero recurrent state and previous action/reward for ``batch`` envs."""
        return PolicyState(self.net.initial_state(batch),
                           torch.zeros(batch, self.action_dim,
                                       dtype=torch.int64 if self.discrete_actions else torch.float32),
                           torch.zeros(batch))

    @torch.no_grad()
    def predict(self, obs: np.ndarray, state: Optional[PolicyState] = None,
                episode_start: Optional[np.ndarray] = None, deterministic: bool = False,
                reward: Optional[np.ndarray] = None) -> tuple[np.ndarray, PolicyState]:
        """Act on a batch of observations (sb3-style ``predict``).

        Args:
            obs: [B, obs_dim] (or [obs_dim] for one env) observations as the agent's env returns
                them (flattened, normalised if ``normalize_obs``).
            state: the PolicyState returned by the previous call, or None (fresh zeros).
            episode_start: [B] bool, True where ``obs`` is the first observation of an episode
                (memory reset for those rows). Default: all True when ``state`` is None, else False.
            deterministic: the mode of the action distribution instead of a sample.
            reward: [B] the reward received after the previous action; needed when the agent
                was trained with ``prev_reward``.

        Returns:
            (actions for the env: [B] / [B, k] / [B, *shape] numpy, new PolicyState);
            single-env input gives a single action.

        Raises:
            ValueError: wrong obs width, or a missing reward when ``prev_reward`` is on.
        """
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
        single = x.dim() == 1
        if single:
            x = x.unsqueeze(0)
        if x.dim() != 2 or x.shape[1] != self.obs_dim:
            raise ValueError(f"predict: obs must be [B, {self.obs_dim}] (or [{self.obs_dim}]), got {tuple(x.shape)}")
        b = x.shape[0]
        if state is None:
            state = self.initial_policy_state(b)
            starts = torch.ones(b, dtype=torch.bool)
        else:
            starts = torch.zeros(b, dtype=torch.bool)
        if episode_start is not None:
            starts = torch.as_tensor(np.asarray(episode_start, dtype=bool).reshape(b))
        if self.config.memoryless:
            starts = torch.ones_like(starts)
        prev_reward = state.prev_reward
        if self.config.prev_reward:
            if reward is None and not bool(starts.all()):
                raise ValueError("predict: this agent uses prev_reward; pass reward= (the last reward, [B])")
            if reward is not None:
                prev_reward = torch.as_tensor(np.asarray(reward, dtype=np.float32).reshape(b))
        stepper = self._predict_steppers.get(b)
        if stepper is None:
            stepper = self._predict_steppers[b] = self.net.stepper(batch=b)
        stepper.load_state(state.recurrent)
        inp = self.build_input(x, state.prev_action, prev_reward, starts)
        feat = stepper.step(inp.to(self.device), episode_starts=starts.to(self.device))
        actor = self.heads["actor"]
        log_std = actor.log_std.detach().cpu() if actor.kind == "gaussian" else None
        dist = actor.dist(actor.linear(feat).cpu(), log_std)  # sampled on the host, as in the rollout
        action = dist.mode() if deterministic else dist.sample(self.sample_generator)
        new_state = PolicyState(stepper.get_state(), action.clone(), prev_reward.clone())
        env_action = self._to_env_action(action)
        return (env_action[0] if single else env_action), new_state

    @torch.no_grad()
    def value(self, obs: np.ndarray, state: PolicyState, episode_start: np.ndarray,
              reward: Optional[np.ndarray] = None) -> np.ndarray:
        """Critic value [B] of ``obs`` with ``state`` (the state is not advanced)."""
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32).reshape(-1, self.obs_dim)
        b = x.shape[0]
        starts = torch.as_tensor(np.asarray(episode_start, dtype=bool).reshape(b))
        if self.config.memoryless:
            starts = torch.ones_like(starts)
        prev_reward = state.prev_reward if reward is None else torch.as_tensor(
            np.asarray(reward, dtype=np.float32).reshape(b))
        stepper = self._predict_steppers.get(b) or self._predict_steppers.setdefault(b, self.net.stepper(batch=b))
        stepper.load_state(state.recurrent)
        feat = stepper.step(self.build_input(x, state.prev_action, prev_reward, starts).to(self.device),
                            episode_starts=starts.to(self.device))
        return self.heads["critic"](feat).cpu().numpy()

    def evaluate(self, num_episodes: int = 10, deterministic: bool = False, seed: Optional[int] = None,
                 video_dir: Optional[str] = None) -> EvalResult:
        """Run ``num_episodes`` episodes in a fresh single env, resetting the memory per episode.

        Episode k resets the env with seed ``seed + k`` (default seed: config.seed + 10_000) and
        starts from a zero recurrent state and zero previous action/reward. With
        ``normalize_obs`` the training statistics are applied, frozen (gymnasium's
        ``NormalizeObservation`` with ``update_running_mean = False``).

        Returns:
            :class:`EvalResult` with returns, lengths and per-step critic values.

        Raises:
            ValueError: ``num_episodes < 1``.
        """
        if num_episodes < 1:
            raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
        c = self.config
        env = make_env(c.env_id, capture_video=video_dir is not None, video_dir=video_dir or "videos")
        norm = find_vector_wrapper(self.envs, gym.wrappers.vector.NormalizeObservation)
        if norm is not None:
            env = gym.wrappers.NormalizeObservation(env)
            env.obs_rms.mean = norm.obs_rms.mean.copy()
            env.obs_rms.var = norm.obs_rms.var.copy()
            env.obs_rms.count = norm.obs_rms.count
            env.update_running_mean = False
        rnorm = find_vector_wrapper(self.envs, gym.wrappers.vector.NormalizeReward)
        # the prev-reward input saw normalised rewards in training: feed the same scale (frozen)
        reward_scale = 1.0 if rnorm is None else float(1.0 / np.sqrt(rnorm.return_rms.var + rnorm.epsilon))
        base_seed = c.seed + 10_000 if seed is None else seed
        returns, lengths, values = [], [], []
        try:
            for ep in range(num_episodes):
                obs, _ = env.reset(seed=base_seed + ep)
                state, start, reward = None, True, 0.0
                total, steps, vals = 0.0, 0, []
                while True:
                    vals.append(float(self.value(obs[None], state or self.initial_policy_state(1), [start],
                                                 reward=[reward * reward_scale])[0]))
                    action, state = self.predict(obs[None], state, episode_start=[start],
                                                 deterministic=deterministic, reward=[reward * reward_scale])
                    obs, reward, term, trunc, _ = env.step(action[0])
                    total += float(reward)
                    steps += 1
                    start = False
                    if term or trunc:
                        break
                returns.append(total)
                lengths.append(steps)
                values.append(np.asarray(vals, dtype=np.float32))
        finally:
            env.close()
        return EvalResult(np.asarray(returns, dtype=np.float64), np.asarray(lengths, dtype=np.int64), values)

    # ----------------------------------------------------------- checkpoints
    def _extra_tensors(self) -> dict[str, torch.Tensor]:
        t: dict[str, torch.Tensor] = {f"heads/{k}": v for k, v in self.heads.state_dict().items()}
        for idx, st in self.head_optimizer.state_dict()["state"].items():
            for key, v in st.items():
                t[f"head_optimizer/{idx}/{key}"] = torch.as_tensor(v)
        t["rng/sample_generator"] = self.sample_generator.get_state()
        t["rng/torch"] = torch.get_rng_state()
        t["carry/stepper_conv"] = self.stepper.state.conv
        t["carry/stepper_ssm"] = self.stepper.state.ssm
        t["carry/next_obs"] = self.next_obs
        t["carry/next_start"] = self.next_start
        t["carry/next_done"] = self.next_done
        t["carry/prev_action"] = self.prev_action
        t["carry/prev_reward"] = self.prev_reward
        return t

    def save(self, path: Union[str, Path]) -> Path:
        """Save everything needed to resume or evaluate into the folder ``path``.

        Files:
            ``agent.safetensors``: one :func:`mamba_rl.save_checkpoint` file: backbone weights,
            AdamW moments, step and scaler; heads, head Adam moments, RNG states and the carried
            rollout state (stepper state, next obs, starts, dones, previous action/reward) as
            extra tensors; PPOConfig, counters, numpy RNG state and observation-normalisation
            statistics as JSON metadata.
            ``envs.pkl``: the vector env mid-episode (SyncVectorEnv stacks that pickle, no video),
            so that a resumed run can continue the very same trajectories. It is a pickle, so it is
            never read unless asked for: ``load(restore_envs=True)`` / ``mamba-rl train --resume PATH
            --resume-envs``, for checkpoints you trust. Everything else is safetensors + JSON.

        Returns:
            ``path`` as a Path.
        """
        from mamba_rl import save_checkpoint

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        norm = find_vector_wrapper(self.envs, gym.wrappers.vector.NormalizeObservation)
        obs_rms = None
        if norm is not None:
            obs_rms = {"mean": norm.obs_rms.mean.tolist(), "var": norm.obs_rms.var.tolist(),
                       "count": float(norm.obs_rms.count)}
        rnorm = find_vector_wrapper(self.envs, gym.wrappers.vector.NormalizeReward)
        return_rms = None
        if rnorm is not None:
            return_rms = {"mean": np.asarray(rnorm.return_rms.mean).tolist(),
                          "var": np.asarray(rnorm.return_rms.var).tolist(), "count": float(rnorm.return_rms.count)}
        opt_sd = self.head_optimizer.state_dict()
        extra = {"format": CHECKPOINT_FORMAT, "ppo_config": self.config.to_dict(), "run_name": self.run_name,
                 "global_step": self.global_step, "update": self.update, "input_dim": self.input_dim,
                 "obs_dim": self.obs_dim, "obs_rms": obs_rms, "return_rms": return_rms, "env_started": self._env_started,
                 "np_rng": self.np_rng.bit_generator.state,
                 "head_optimizer_param_groups": opt_sd["param_groups"],
                 "head_optimizer_state_keys": {str(k): sorted(v) for k, v in opt_sd["state"].items()},
                 "recent_returns": [float(r) for r in self.recent_returns]}
        save_checkpoint(str(path / "agent.safetensors"), self.trainer, extra=extra,
                        extra_tensors=self._extra_tensors())
        env_file = path / "envs.pkl"
        if self._env_started and isinstance(self.envs.unwrapped, gym.vector.SyncVectorEnv) \
                and not self.config.capture_video:
            try:
                blob = pickle.dumps(self.envs)
            except Exception as err:  # lambdas in wrappers (e.g. FlattenObservation), third-party envs
                if not self._warned_pickle:
                    warnings.warn(f"envs could not be pickled ({err}); resuming from this run's checkpoints "
                                  "restores the learner exactly but resets the envs")
                    self._warned_pickle = True
            else:
                with open(path / "envs.pkl.tmp", "wb") as f:
                    f.write(blob)
                os.replace(path / "envs.pkl.tmp", env_file)
        elif env_file.exists():
            env_file.unlink()
        return path

    @staticmethod
    def checkpoint_file(path: Union[str, Path]) -> Path:
        """``path/agent.safetensors`` for a folder, ``path`` itself for a file.

        Raises:
            FileNotFoundError: neither exists.
        """
        path = Path(path)
        f = path / "agent.safetensors" if path.is_dir() else path
        if not f.is_file():
            raise FileNotFoundError(f"no RecurrentPPO checkpoint at {path} (expected a folder holding "
                                    f"agent.safetensors, or that file)")
        return f

    @classmethod
    def load(cls, path: Union[str, Path], env: Union[str, gym.vector.VectorEnv, None] = None,
             restore_envs: bool = False, **overrides: Any) -> "RecurrentPPO":
        """Rebuild an agent from a :meth:`save` folder, ready to ``learn`` on (resume) or evaluate.

        Args:
            path: checkpoint folder (or its ``agent.safetensors``).
            env: replace the env (then the carried env state is not restored).
            restore_envs: unpickle ``envs.pkl`` when present, so training continues the exact
                trajectories (trusted checkpoints only); otherwise the envs are rebuilt and reset.
            **overrides: PPOConfig fields to change (e.g. ``device``, ``total_timesteps``).

        Raises:
            FileNotFoundError: no checkpoint there. ValueError / mamba_rl.checkpoint.CheckpointError:
            not a RecurrentPPO checkpoint, or one that does not fit.
        """
        from mamba_rl import load_checkpoint, read_checkpoint

        ckpt = cls.checkpoint_file(path)
        meta, _ = read_checkpoint(ckpt)
        extra = meta.get("extra", {})
        if extra.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{ckpt}: expected checkpoint format {CHECKPOINT_FORMAT!r}, got {extra.get('format')!r}")
        config = PPOConfig.from_dict(extra["ppo_config"])
        if overrides:
            config = config.replace(**overrides)
        env_file = ckpt.parent / "envs.pkl"
        restore = restore_envs and env is None and env_file.exists()
        if restore:
            agent = cls._with_envs(config, env_file)
        else:
            agent = cls(env if env is not None else config.env_id, config=config)
        meta = load_checkpoint(ckpt, agent.trainer)
        t = {k: v.to(agent.device) for k, v in meta["extra_tensors"].items()}
        agent.heads.load_state_dict({k[len("heads/"):]: v for k, v in t.items() if k.startswith("heads/")})
        opt_state = {int(idx): {key: t[f"head_optimizer/{idx}/{key}"] for key in keys}
                     for idx, keys in extra["head_optimizer_state_keys"].items()}
        for st in opt_state.values():
            if "step" in st:
                st["step"] = st["step"].cpu()
        agent.head_optimizer.load_state_dict({"state": opt_state,
                                              "param_groups": extra["head_optimizer_param_groups"]})
        agent.sample_generator.set_state(meta["extra_tensors"]["rng/sample_generator"])
        torch.set_rng_state(meta["extra_tensors"]["rng/torch"])
        agent.np_rng.bit_generator.state = extra["np_rng"]
        agent.run_name = extra["run_name"]
        agent.global_step = int(extra["global_step"])
        agent.update = int(extra["update"])
        agent.recent_returns.extend(extra.get("recent_returns", []))
        if restore:
            agent.stepper.state.conv.copy_(t["carry/stepper_conv"])
            agent.stepper.state.ssm.copy_(t["carry/stepper_ssm"])
            for name in ("next_obs", "next_start", "next_done", "prev_action", "prev_reward"):
                setattr(agent, name, t[f"carry/{name}"].cpu().clone())  # host-side, like the rollout
            agent._env_started = bool(extra["env_started"])
        else:  # fresh envs: restore the normalisation statistics
            for key, wrapper, attr in (("obs_rms", gym.wrappers.vector.NormalizeObservation, "obs_rms"),
                                       ("return_rms", gym.wrappers.vector.NormalizeReward, "return_rms")):
                w = find_vector_wrapper(agent.envs, wrapper)
                if w is not None and extra.get(key) is not None:
                    rms = getattr(w, attr)
                    rms.mean = np.asarray(extra[key]["mean"], dtype=np.float64).reshape(np.shape(rms.mean))
                    rms.var = np.asarray(extra[key]["var"], dtype=np.float64).reshape(np.shape(rms.var))
                    rms.count = extra[key]["count"]
        return agent

    @classmethod
    def _with_envs(cls, config: PPOConfig, env_file: Path) -> "RecurrentPPO":
        with open(env_file, "rb") as f:
            envs = pickle.load(f)
        return cls(envs, config=config)

    def close(self) -> None:
        """Close the envs and the TensorBoard writer."""
        self.envs.close()
        if self._logger is not None:
            self._logger.close()
