"""The recurrent policy: Mamba backbone + linear actor/critic heads, and how it acts.

A :class:`Policy` owns the backbone (:class:`mamba_rl.MambaBackbone`), the two heads and the
backbone input format: the (flattened) observation, then, when configured, the previous action
(one-hot for discrete spaces) and the previous reward, both zero at an episode start. Acting is
one backbone step (a stepper of the backbone) followed by both heads, so one step gives both the
action and the value (see docs/architecture.md, "Agent loop"; episode starts reset the memory as
in "Reset semantics").

The input is built in numpy, in one place (:class:`HostStager`): the rollout stages every env step
through it, and :meth:`Policy.act` (``predict``, evaluation) through the same code. :meth:`Policy.act`
samples on the host with the ``torch.Generator`` its caller passes (``predict`` and evaluation own one
each, never the rollout's), so acting never changes a training run; the rollout samples elsewhere
(:mod:`mamba_rl.agents.rollout`, :mod:`mamba_rl.agents.device_actor`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from mamba_rl import MambaBackbone, MambaConfig, RecurrentState, Stepper
from mamba_rl.envs import JointAction, make_env, requires_prev_action

from .heads import ActionDist, ActorHead, CriticHead, _layer_init, action_dim, action_input_dim, action_set_size
from .validation import check_bool_or_auto

__all__ = ["Policy", "PolicyState", "HostStager", "prev_action_input", "time_features", "check_action_options"]


@dataclass
class PolicyState:
    """What :meth:`Policy.act` carries between calls for a batch of B envs.

    Attributes:
        recurrent: backbone RecurrentState (conv [L,B,d_inner,d_conv-1], ssm [L,B,d_inner,d_state]).
        prev_action: [B, action_dim] last action returned (int64 or float32).
        prev_reward: [B] float32 last reward passed in.
        episode_step: [B] int64 in-episode step of the observation last acted on (0: an episode's first), the
            time encoding's input (:func:`time_features`); the next call acts on step + 1, or 0 where a row
            starts an episode.
    """

    recurrent: RecurrentState
    prev_action: torch.Tensor
    prev_reward: torch.Tensor
    episode_step: torch.Tensor


class Policy:
    """Backbone + heads for one observation width and action space.

    Args:
        backbone: the backbone's :class:`mamba_rl.MambaConfig`.
        obs_dim: width of the flattened observation.
        action_space: the single-env action space (Discrete, MultiDiscrete 1-D, Box).
        device: where the backbone and heads live.
        seed: seeds the backbone init and the heads' orthogonal init.
        backend: backbone backend, "auto" | "cuda" | "cpu" | "reference".
        prev_action, prev_reward: append the previous action / reward to the input.
        time_encoding: K > 0 appends :func:`time_features` of the in-episode step (2K columns) to the input.
        memoryless: treat every step as an episode start (ablation baseline).
        aux_critic: add the two-horizon critic's second value head ``heads["aux_critic"]``
            (:attr:`PPOConfig.aux_gamma`), initialised after the actor and critic from the same generator, so
            those two start as without it.
        action_set: add the action-set head ``heads["action_set"]`` (:attr:`PPOConfig.action_set_coef`): a
            Linear(d_model, K) (CleanRL's init, gain 1), K the number of actions (joint actions of a
            MultiDiscrete space), initialised after every other head, which start as without it. The update
            trains it; acting never computes it.

    Raises:
        TypeError: an unsupported action space.
        ValueError: ``action_set`` with a Box action space, or a MultiDiscrete one of more than
            ``mamba_rl.envs.MAX_JOINT_ACTIONS`` joint actions.
    """

    def __init__(self, backbone: MambaConfig, obs_dim: int, action_space: spaces.Space, device: torch.device,
                 seed: int, backend: str = "auto", prev_action: bool = False, prev_reward: bool = False,
                 memoryless: bool = False, aux_critic: bool = False, time_encoding: int = 0,
                 action_set: bool = False):
        self.obs_dim = int(obs_dim)
        self.action_space = action_space
        self.action_dim = action_dim(action_space)
        self.discrete_actions = not isinstance(action_space, spaces.Box)
        self.use_prev_action, self.use_prev_reward, self.memoryless = prev_action, prev_reward, memoryless
        self.input_dim = self.obs_dim
        if prev_action:
            self.input_dim += action_input_dim(action_space)
        if prev_reward:
            self.input_dim += 1
        self.time_encoding = int(time_encoding)
        self.input_dim += 2 * self.time_encoding
        self.device = device
        init_gen = torch.Generator().manual_seed(seed)
        self.net = MambaBackbone(backbone, self.input_dim, device=device, seed=seed, backend=backend)
        self.heads = nn.ModuleDict({
            "actor": ActorHead(backbone.d_model, action_space, init_gen),
            "critic": CriticHead(backbone.d_model, init_gen),
        })
        if aux_critic:  # the two-horizon critic (PPOConfig.aux_gamma): parameters after the others'
            self.heads["aux_critic"] = CriticHead(backbone.d_model, init_gen)
        if action_set:  # the action-set loss (PPOConfig.action_set_coef): parameters after every other head's
            self.heads["action_set"] = _layer_init(nn.Linear(backbone.d_model, action_set_size(action_space)), 1.0,
                                                   init_gen)
        self.heads.to(device)
        self._steppers: dict[int, Stepper] = {}
        self._stagers: dict[int, HostStager] = {}

    @property
    def actor(self) -> ActorHead:
        """The actor head (``heads["actor"]``): features [.., d_model] -> an :class:`ActionDist`."""
        return self.heads["actor"]

    @property
    def critic(self) -> CriticHead:
        """The critic head (``heads["critic"]``): features [.., d_model] -> values [..]."""
        return self.heads["critic"]

    @property
    def aux_critic(self) -> CriticHead | None:
        """The two-horizon critic's second value head (``heads["aux_critic"]``, :attr:`PPOConfig.aux_gamma`),
        None when the policy has none."""
        return self.heads["aux_critic"] if "aux_critic" in self.heads else None

    @property
    def action_set(self) -> nn.Linear | None:
        """The action-set head (``heads["action_set"]``, :attr:`PPOConfig.action_set_coef`): features
        [.., d_model] -> one logit per (joint) action [.., K]; None when the policy has none."""
        return self.heads["action_set"] if "action_set" in self.heads else None

    @property
    def value_heads(self) -> int:
        """Value columns after the actor's in :meth:`fused_heads`: 1, or 2 with the aux critic."""
        return 1 if self.aux_critic is None else 2

    # ---------------------------------------------------------------- inputs
    def stager(self, batch: int) -> HostStager:
        """The :class:`HostStager` of ``batch`` rows over a stage of its own (one per batch size, reused)."""
        st = self._stagers.get(batch)
        if st is None:
            st = self._stagers[batch] = HostStager(self, np.zeros((batch, self.input_dim + 1), np.float32))
        return st

    def host_log_std(self) -> torch.Tensor | None:
        """The Gaussian log-std on the host (actions are sampled there), None for discrete spaces."""
        actor = self.actor
        return actor.log_std.detach().cpu() if actor.kind == "gaussian" else None

    def fused_linears(self) -> list[nn.Linear]:
        """The heads' Linear layers in :meth:`fused_heads`' column order: actor, critic (, aux critic)."""
        lin = [self.actor.linear, self.critic.linear]
        if self.aux_critic is not None:
            lin.append(self.aux_critic.linear)
        return lin

    def fused_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [d_model, out_dim + V], bias [out_dim + V]) float32, V = :attr:`value_heads`: the heads as one
        GEMM, actor outputs first, then the value (column ``out_dim``) and, with the aux critic, its value
        (column ``out_dim + 1``); the rollout applies them with one ``addmm`` per step."""
        lin = self.fused_linears()
        with torch.no_grad():
            w = torch.cat([x.weight for x in lin]).t().contiguous()
            bias = torch.cat([x.bias for x in lin])
        return w, bias

    # ---------------------------------------------------------------- acting
    def initial_state(self, batch: int) -> PolicyState:
        """Zero recurrent state, previous action / reward and in-episode step for ``batch`` envs."""
        return PolicyState(self.net.initial_state(batch),
                           torch.zeros(batch, self.action_dim,
                                       dtype=torch.int64 if self.discrete_actions else torch.float32),
                           torch.zeros(batch), torch.zeros(batch, dtype=torch.int64))

    def _stepper(self, batch: int) -> Stepper:
        stepper = self._steppers.get(batch)
        if stepper is None:
            stepper = self._steppers[batch] = self.net.stepper(batch=batch)
        return stepper

    def _obs(self, obs: np.ndarray, who: str = "predict") -> tuple[torch.Tensor, bool]:
        """``obs`` as float32 [B, obs_dim] and whether it was one row; ValueError for another shape, a
        non-real dtype, no rows, or a NaN / inf value (which would make the recurrent state NaN for good)."""
        arr = np.asarray(obs)
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"{who}: obs must be real numbers (bool, int or float), got dtype {arr.dtype}")
        x = torch.as_tensor(arr, dtype=torch.float32)
        single = x.dim() == 1
        if single:
            x = x.unsqueeze(0)
        if x.dim() != 2 or x.shape[1] != self.obs_dim or x.shape[0] < 1:
            raise ValueError(f"{who}: obs must be [B, {self.obs_dim}] with B >= 1 (or [{self.obs_dim}]), got "
                             f"{tuple(arr.shape)}")
        bad = ~torch.isfinite(x).all(dim=1)
        if bool(bad.any()):
            raise ValueError(f"{who}: obs rows {torch.nonzero(bad).flatten().tolist()[:8]} hold NaN / inf values "
                             f"(expected finite observations: a non-finite one would make those envs' memory NaN)")
        return x, single

    def _features(self, x: torch.Tensor, state: PolicyState, starts: torch.Tensor, prev_reward: torch.Tensor,
                  episode_step: torch.Tensor) -> tuple[torch.Tensor, RecurrentState]:
        """One backbone step from ``state``: (features [B, d_model], the new recurrent state)."""
        b = x.shape[0]
        stepper, stager = self._stepper(b), self.stager(b)
        stepper.load_state(state.recurrent)
        stager.build(x.numpy(), state.prev_action.numpy(), prev_reward.numpy(), starts.numpy(), episode_step.numpy())
        inp = torch.from_numpy(stager.stage[:, :-1]).to(self.device).contiguous()
        feat = stepper.step(inp, episode_starts=starts.to(self.device))
        return feat, stepper.get_state()

    @torch.no_grad()
    def act(self, obs: np.ndarray, state: PolicyState | None = None, episode_start: np.ndarray | None = None,
            deterministic: bool = False, reward: np.ndarray | None = None,
            generator: torch.Generator | None = None) -> tuple[np.ndarray, PolicyState, np.ndarray]:
        """One backbone step for a batch of observations: the action, the new state and the value.

        Args:
            obs: [B, obs_dim] (or [obs_dim] for one env) observations as the agent's env returns them.
            state: the PolicyState returned by the previous call, or None (fresh zeros).
            episode_start: [B] bool, True where ``obs`` is the first observation of an episode
                (memory reset for those rows). Default: all True when ``state`` is None, else False.
            deterministic: the mode of the action distribution instead of a sample.
            reward: [B] the reward received after the previous action; needed with ``prev_reward``.
            generator: the sampling generator (the agent's, for reproducible runs).

        Returns:
            (env actions: [B] / [B, k] / [B, *shape] numpy, or one action for single-env input;
            the new PolicyState; the critic values V(obs) [B] float32 numpy, from the same step).

        Raises:
            ValueError: wrong obs width; with ``prev_reward``, a missing reward (where a row does not start an
                episode), or one that is not [B] finite numbers.
        """
        x, single = self._obs(obs)
        b = x.shape[0]
        if state is None:
            state = self.initial_state(b)
            starts = torch.ones(b, dtype=torch.bool)
        else:
            if not isinstance(state, PolicyState):
                raise ValueError(f"predict: state must be the PolicyState a previous call returned (or None), got "
                                 f"{type(state).__name__}")
            starts = torch.zeros(b, dtype=torch.bool)
        if not isinstance(deterministic, (bool, np.bool_)):
            raise ValueError(f"predict: deterministic must be a bool, got {deterministic!r}")
        if episode_start is not None:
            starts = torch.as_tensor(_per_env("episode_start", episode_start, b, bool))
        steps = _next_steps(state, starts, "predict")  # the episode's own clock, also under memoryless (as in the rollout)
        if self.memoryless:
            starts = torch.ones_like(starts)
        prev_reward = self._prev_reward(reward, state.prev_reward, starts, "predict")
        feat, recurrent = self._features(x, state, starts, prev_reward, steps)
        dist: ActionDist = self.actor.dist(self.actor.linear(feat).cpu(), self.host_log_std())  # sampled on the host
        value = self.critic(feat).cpu().numpy()
        action = dist.mode() if deterministic else dist.sample(generator)
        new_state = PolicyState(recurrent, action.clone(), prev_reward.clone(), steps)
        env_action = self.stager(b).to_env(action.numpy())
        return (env_action[0] if single else env_action), new_state, value

    def _prev_reward(self, reward, held: torch.Tensor, starts: torch.Tensor, who: str) -> torch.Tensor:
        """The previous-reward input [B] float32 of :meth:`act` / :meth:`value`: ``reward`` checked (one number per
        env, finite where the row does not start an episode; rows that start one read 0) with ``prev_reward`` on;
        ``held`` (the state's, unused) without it. A missing reward where some row does not start an episode is a
        ValueError."""
        if not self.use_prev_reward:
            return held
        b = starts.shape[0]
        if reward is None:
            if not bool(starts.all()):
                raise ValueError(f"{who}: this agent uses prev_reward; pass reward= (the last reward, [{b}])")
            return torch.zeros(b)
        r = _per_env("reward", reward, b, np.float32, who)
        start = starts.numpy()
        bad = ~np.isfinite(r) & ~start  # a row that starts an episode does not read it
        if bad.any():
            raise ValueError(f"{who}: reward must be finite, got {r[bad][:4].tolist()} (after the agent's reward "
                             f"scaling, in float32)")
        return torch.as_tensor(np.where(start, np.float32(0), r))

    @torch.no_grad()
    def value(self, obs: np.ndarray, state: PolicyState, episode_start: np.ndarray,
              reward: np.ndarray | None = None) -> np.ndarray:
        """Critic value V(obs) [B] float32 (numpy) with ``state`` (the state is not advanced).

        Args:
            obs: [B, obs_dim] (or [obs_dim]) float observations, as for :meth:`act`.
            state: the PolicyState of B envs that :meth:`act` returned.
            episode_start: [B] bool, True where ``obs`` starts an episode (those rows' memory reset).
            reward: [B] the reward received after the action ``state`` holds; needed with ``prev_reward`` (as
                in :meth:`act`) where a row does not start an episode.

        Raises:
            ValueError: an obs of another width, no rows, NaN / inf values; a ``state`` that is not a
                PolicyState of B envs; an ``episode_start`` without one value per env; with ``prev_reward``, a
                missing reward, or one that is not [B] finite numbers.
        """
        x, _ = self._obs(obs, "value")
        b = x.shape[0]
        if not isinstance(state, PolicyState):
            raise ValueError(f"value: state must be the PolicyState that act / predict returned, got "
                             f"{type(state).__name__}")
        if state.recurrent.ssm.shape[1] != b:
            raise ValueError(f"value: obs has {b} rows but state holds {state.recurrent.ssm.shape[1]} envs")
        if episode_start is None:
            raise ValueError(f"value: episode_start must be [{b}] bools, got None")
        starts = torch.as_tensor(_per_env("episode_start", episode_start, b, bool, "value"))
        steps = _next_steps(state, starts, "value")
        if self.memoryless:
            starts = torch.ones_like(starts)
        prev_reward = self._prev_reward(reward, state.prev_reward, starts, "value")
        feat, _ = self._features(x, state, starts, prev_reward, steps)
        return self.critic(feat).cpu().numpy()


def _next_steps(state: PolicyState, starts: torch.Tensor, who: str) -> torch.Tensor:
    """The in-episode step [B] int64 of the observation acted on now: 0 where a row starts an episode, else one
    past the state's. ValueError for a state's ``episode_step`` that is not [B]."""
    held = state.episode_step
    if not isinstance(held, torch.Tensor) or tuple(held.shape) != tuple(starts.shape):
        raise ValueError(f"{who}: state.episode_step must be a [{starts.shape[0]}] tensor (the PolicyState a "
                         f"previous call returned for these envs), got "
                         f"{tuple(held.shape) if isinstance(held, torch.Tensor) else type(held).__name__}")
    return torch.where(starts, 0, held.to(torch.int64) + 1)


def time_features(episode_step: np.ndarray, k: int, out: np.ndarray | None = None) -> np.ndarray:
    """The time encoding of :attr:`PPOConfig.time_encoding` = ``k``: [N, 2k] float32, columns
    ``sin(2 pi t / P_j)`` for j < k, then ``cos(2 pi t / P_j)``, with periods P_j = 2^(j + 2) steps (4, 8, ...)
    and t = ``episode_step`` [N] (int, 0 at an episode's first observation). The sinusoidal positional encoding
    of Vaswani et al. (2017), "Attention is all you need", section 3.5, with periods doubling from 4 steps: a
    memory can address "the observation d steps ago" as a fixed rotation of these features. Written into
    ``out`` ([N, 2k] float32 view) when given, and returned.

    Raises:
        ValueError: ``k`` < 1, or an ``episode_step`` that is not [N] non-negative integers.
    """
    t = np.asarray(episode_step)
    if k < 1:
        raise ValueError(f"time_features: k must be >= 1, got {k}")
    if t.ndim != 1 or t.dtype.kind not in "iu" or (t.size and t.min() < 0):
        raise ValueError(f"time_features: episode_step must be [N] non-negative integers, got dtype {t.dtype} "
                         f"shape {t.shape}")
    phase = t[:, None].astype(np.float64) * (2 * np.pi / 2.0 ** np.arange(2, k + 2))
    if out is None:
        out = np.empty((t.shape[0], 2 * k), np.float32)
    np.sin(phase, out=out[:, :k], casting="same_kind")
    np.cos(phase, out=out[:, k:], casting="same_kind")
    return out


def _per_env(name: str, value, batch: int, dtype, who: str = "predict") -> np.ndarray:
    """``value`` as a [batch] array of ``dtype``; ValueError naming ``name`` when it holds another number of
    values (one per env is expected), or, for a bool ``dtype``, values other than bools or 0 / 1."""
    raw = np.asarray(value)
    if dtype is bool and not (raw.dtype.kind == "b" or (raw.dtype.kind in "iuf" and np.isin(raw, (0, 1)).all())):
        raise ValueError(f"{who}: {name} must be bools (or 0 / 1), got dtype {raw.dtype} with values "
                         f"{raw.reshape(-1)[:4].tolist()}")
    if raw.dtype.kind not in "biuf":
        raise ValueError(f"{who}: {name} must be numbers, got dtype {raw.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # out of float32's range -> inf: the caller names it
        arr = raw.astype(dtype)
    if arr.size != batch:
        raise ValueError(f"{who}: {name} must hold one value per env, expected shape [{batch}], got "
                         f"{list(arr.shape)}")
    return arr.reshape(batch)


def check_action_options(env_id: str, joint_action: bool, action_set_coef: float, check_space: bool = False) -> None:
    """Check up front that ``env_id``'s action space takes :attr:`PPOConfig.joint_action` and the action-set loss
    (:attr:`PPOConfig.action_set_coef` > 0), building one env of it when either is on or ``check_space`` is
    True (nothing otherwise): what the agent would find out while building its envs and heads, for the CLI to
    report before any run folder (``check_space``: also an action space the agent takes in no form, for a caller
    that will not build the agent itself, e.g. before launching data-parallel ranks).

    Raises:
        ValueError: naming the field: ``joint_action`` for an action space that is not a 1-D MultiDiscrete of at
            most ``mamba_rl.envs.MAX_JOINT_ACTIONS`` combinations, the action-set loss for a Box action space or
            too many (joint) actions.
        mamba_rl.envs.UnsupportedActionSpace: an action space the agent takes in no form (the env's
            fault, not an option's).
    """
    if not joint_action and action_set_coef <= 0 and not check_space:
        return
    env = make_env(env_id, flatten_obs=False)
    try:
        space = env.action_space
        if joint_action:
            try:
                space = JointAction(env).action_space
            except ValueError as err:
                raise ValueError(f"PPOConfig.joint_action: {err}") from err
        if action_set_coef > 0:
            action_set_size(space)
        else:
            action_dim(space)  # UnsupportedActionSpace where the agent takes it in no form
    finally:
        env.close()


def prev_action_input(setting: bool | str, envs: gym.vector.VectorEnv, env_id: str | None = None) -> bool:
    """Whether the policy takes the previous action as input, for ``PPOConfig.prev_action`` = ``setting``.

    True / False are taken as given. ``"auto"``: on for a discrete action space (Discrete, MultiDiscrete: a one-hot
    input) and wherever the env declares ``obs_requires_prev_action`` (POPGym's MultiarmedBandit, Battleship,
    Concentration: :func:`mamba_rl.envs.requires_prev_action`, which reads it, building one env of ``env_id`` for an
    async vector env); off for a Box action space otherwise, where the input is the sampled action, exploration
    noise included. Measured at 200k env steps (benchmarks/learning/README.md): with the previous action,
    NoisyPositionOnlyCartPoleEasy 0.673 -> 0.894 MMER (6 seeds) and MultiarmedBanditEasy 0.155 -> 0.363 (6), the
    other discrete tasks and CartPoleNoVel-v1 (24 of 25 seeds >= 475 against 23 of 25) as without; on Box actions
    PendulumNoVel-v1 -182 -> -222 (8 seeds) and PositionOnlyPendulumEasy 0.886 -> 0.879.

    Raises:
        ValueError: ``setting`` not True, False or "auto".
    """
    setting = check_bool_or_auto("prev_action", setting)
    if setting != "auto":
        return setting
    return not isinstance(envs.single_action_space, spaces.Box) or requires_prev_action(envs, env_id)


class HostStager:
    """Backbone inputs and env actions in numpy, written into a caller's staging array.

    ``stage`` [N, input_dim + 1] float32 (pinned on CUDA) receives per step the backbone input of
    the policy's input layout (obs, previous action encoding: one-hot when discrete, clipped for Box;
    previous reward; both zero at an episode start; the time encoding of the in-episode step,
    :func:`time_features`) and, in its last column, the episode-start flag (1.0 / 0.0).

    Args:
        policy: the :class:`~mamba_rl.agents.policy.Policy` (input layout, action space).
        stage: the [N, input_dim + 1] float32 numpy array to write.
    Raises:
        ValueError: a stage of the wrong shape or dtype.
    """

    def __init__(self, policy: Policy, stage: np.ndarray):
        n, d = stage.shape[0], policy.input_dim
        if stage.shape != (n, d + 1) or stage.dtype != np.float32:
            raise ValueError(f"HostStager: stage must be float32 [N, {d + 1}], got {stage.dtype} {stage.shape}")
        self.policy, self.stage, self.n = policy, stage, n
        self.space = space = policy.action_space
        self.obs_dim = policy.obs_dim
        self.rows = np.arange(n)
        col = self.obs_dim
        self.act_cols = self.reward_col = None
        if policy.use_prev_action:
            self.act_cols = slice(col, col + action_input_dim(space))
            col += action_input_dim(space)
        if policy.use_prev_reward:
            self.reward_col = col
            col += 1
        self.time_k = policy.time_encoding
        self.time_cols = slice(col, col + 2 * self.time_k) if self.time_k else None
        self.start = 0
        if isinstance(space, spaces.Discrete):
            self.start = int(space.start)
        elif isinstance(space, spaces.MultiDiscrete):
            self.start = np.asarray(space.start).reshape(1, -1)
            self.offsets = np.concatenate([[0], np.cumsum(space.nvec)[:-1]]).reshape(1, -1)
        else:
            self.low = np.asarray(space.low, np.float32).reshape(1, -1)
            self.high = np.asarray(space.high, np.float32).reshape(1, -1)

    def build(self, obs: np.ndarray, prev_action: np.ndarray, prev_reward: np.ndarray, start: np.ndarray,
              episode_step: np.ndarray | None = None) -> None:
        """Write the input of obs [N, ...], prev_action [N, action_dim] (stored form), prev_reward [N],
        start [N] bool and episode_step [N] int (the in-episode step of ``obs``; needed with a time encoding)
        into ``stage``.

        Raises:
            ValueError: a time-encoding policy and no ``episode_step``."""
        x, n = self.stage, self.n
        x[:, : self.obs_dim] = np.reshape(obs, (n, self.obs_dim))
        keep = ~start
        if self.act_cols is not None:
            blk = x[:, self.act_cols]
            if isinstance(self.space, spaces.Discrete):
                blk.fill(0.0)
                blk[self.rows, prev_action[:, 0]] = keep
            elif isinstance(self.space, spaces.MultiDiscrete):
                blk.fill(0.0)
                blk[self.rows[:, None], prev_action + self.offsets] = keep[:, None]
            else:
                np.clip(prev_action, self.low, self.high, out=blk)
                blk[start] = 0.0  # a select, not a multiply: a NaN / inf of the old episode never leaks
        if self.reward_col is not None:
            x[:, self.reward_col] = np.where(keep, prev_reward, 0.0)
        if self.time_cols is not None:
            if episode_step is None:
                raise ValueError(f"HostStager.build: this policy's input has a time encoding (time_encoding="
                                 f"{self.time_k}); pass episode_step ([{n}] ints)")
            time_features(episode_step, self.time_k, out=x[:, self.time_cols])
        x[:, -1] = start

    def to_env(self, action: np.ndarray) -> np.ndarray:
        """Stored actions [N, action_dim] -> env actions (``start`` added, Box clipped to its bounds)."""
        if isinstance(self.space, spaces.Discrete):
            return action[:, 0] + self.start
        if isinstance(self.space, spaces.MultiDiscrete):
            return action + self.start
        a = np.clip(action, self.low, self.high).astype(self.space.dtype)
        return a.reshape((self.n,) + self.space.shape)
