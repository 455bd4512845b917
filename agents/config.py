"""PPOConfig: every hyperparameter of the recurrent PPO agent, validated at construction.

Defaults start from CleanRL's ``ppo.py`` / ``ppo_atari_lstm.py`` (Huang et al. 2022, "CleanRL"): 8 envs x 128
steps, gamma 0.99, GAE lambda 0.95, 4 minibatches, clip 0.2 (also on the value), value 0.5, max grad norm 0.5,
Adam eps 1e-5, lr linearly annealed. What differs was measured on the memory tasks (benchmarks/learning/README.md):
lr 2e-3, 3 epochs stopped early past ``target_kl`` 0.02, no entropy bonus, a floor on a Box action's std
(``min_action_std``), no per-minibatch advantage normalisation, the previous action as an input for discrete
actions and the previous reward for every env, and gymnasium's NormalizeObservation (its statistics frozen after
20,000 env steps; continuous observations only) and NormalizeReward (actor and critic share the backbone, see
``normalize_reward``).
The backbone is a :class:`mamba_rl.MambaConfig` (field ``backbone``), with its defaults:
d_model 128, 3 layers, d_state 16, d_conv 4, expand 2, dt_rank "auto", rms_norm_eps 1e-5.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from mamba_rl import MambaConfig

from .validation import check_bool, check_bool_or_auto, check_choice, check_int, check_real

__all__ = ["PPOConfig", "BACKBONE_FIELDS", "OVERLAP_MIN_ENVS"]

# MambaConfig's constructor fields: PPOConfig(...), replace(...) and from_dict(...) also take them flat
BACKBONE_FIELDS = tuple(f.name for f in dataclasses.fields(MambaConfig) if f.init)

_DEVICES = ("auto", "cpu", "cuda")
MAX_THREADS = 1024
# env_overlap="auto" turns the two-halves overlap on from this many envs (EnvPool): measured with the CUDA graph
# actor on an H200, where below it a vector step of EnvPool is shorter than the two half-batch act replays it
# would hide (benchmarks/README.md); the CPU's eager actor takes the same threshold (not measured there)
OVERLAP_MIN_ENVS = 1024
_DTYPES = ("f32", "tf32", "bf16", "f16")
_BACKENDS = ("auto", "cuda", "cpu", "reference")
_NONFINITE = ("raise", "zero")
_ENV_BACKENDS = ("gymnasium", "envpool", "auto")  # mamba_rl.envs.ENV_BACKENDS
_ENV_OVERLAP = ("auto", "on", "off")
MAX_TIME_ENCODING = 16  # PPOConfig.time_encoding: periods up to 2^17 steps
_BOOL_FIELDS = ("cuda_graphs", "async_envs", "anneal_lr", "replan_lr", "norm_adv", "clip_vloss", "prev_reward",
                "normalize_obs", "obs_norm_discrete", "normalize_reward", "memoryless", "capture_video", "track",
                "joint_action", "anneal_action_set")
# (field, lo, hi, lo open, None allowed)
_REAL_FIELDS = (("learning_rate", 0.0, 1.0, True, False), ("adam_eps", 0.0, 1.0, True, False),
                ("weight_decay", 0.0, 1.0, False, False), ("gamma", 0.0, 1.0, False, False),
                ("gae_lambda", 0.0, 1.0, False, False), ("clip_coef", 0.0, math.inf, True, False),
                ("ent_coef", 0.0, math.inf, False, False), ("vf_coef", 0.0, math.inf, False, False),
                ("max_grad_norm", 0.0, math.inf, True, True), ("target_kl", 0.0, math.inf, True, True),
                ("max_minibatch_kl", 0.0, math.inf, True, True),
                ("min_action_std", 0.0, 1.0, False, False), ("aux_gamma", 0.0, 1.0, False, True),
                ("aux_gae_lambda", 0.0, 1.0, False, False), ("aux_adv_weight", 0.0, 1.0, False, False),
                ("aux_adv_add", 0.0, 1000.0, False, True), ("action_set_coef", 0.0, 1000.0, False, False))


@dataclass
class _PPOFields:
    """The fields and checks of :class:`PPOConfig` (which adds the flat backbone arguments)."""

    env_id: str = "mamba_rl/CartPoleNoVel-v1"
    exp_name: str = "mamba_ppo"
    seed: int = 1
    total_timesteps: int = 100_000
    device: str = "auto"
    dtype: str = "f32"
    backend: str = "auto"
    cuda_graphs: bool = True
    num_envs: int = 8
    num_steps: int = 128
    async_envs: bool = False
    async_start_method: str | None = None
    env_backend: str = "gymnasium"
    env_overlap: str = "auto"
    threads: int = 0
    learning_rate: float = 2e-3
    anneal_lr: bool = True
    replan_lr: bool = False
    adam_eps: float = 1e-5
    weight_decay: float = 0.0
    gamma: float = 0.99
    gae_lambda: float = 0.95
    aux_gamma: float | None = 0.0
    aux_gae_lambda: float = 0.65
    aux_adv_weight: float = 0.3
    aux_adv_add: float | None = 6.0
    num_minibatches: int = 4
    update_epochs: int = 3
    norm_adv: bool = False
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float | None = 0.5
    target_kl: float | None = 0.02
    max_minibatch_kl: float | None = None
    min_action_std: float = 0.2
    action_set_coef: float = 0.0
    anneal_action_set: bool = False
    backbone: MambaConfig = field(default_factory=MambaConfig)
    prev_action: bool | str = "auto"
    prev_reward: bool = True
    time_encoding: int = 0
    normalize_obs: bool = True
    obs_norm_discrete: bool = True
    obs_norm_freeze_steps: int = 20_000
    normalize_reward: bool = True
    joint_action: bool = False
    memoryless: bool = False
    nonfinite: str = "raise"
    capture_video: bool = False
    runs_dir: str = "runs"
    track: bool = True
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        if not isinstance(self.backbone, MambaConfig):
            raise ValueError(f"PPOConfig.backbone must be a MambaConfig, got {type(self.backbone).__name__}")

        def name(field_name: str) -> str:
            return f"PPOConfig.{field_name}"

        # seed: numpy's SeedSequence and the env seeds (seed + i) take it; threads: an OpenMP pool of more
        # than a few thousand threads makes libgomp crash the process instead of failing
        check_int(name("seed"), self.seed, lo=0, hi=2**32 - 1 - 2**20)
        check_int(name("checkpoint_every"), self.checkpoint_every, lo=0)
        check_int(name("obs_norm_freeze_steps"), self.obs_norm_freeze_steps, lo=0)
        check_int(name("time_encoding"), self.time_encoding, lo=0, hi=MAX_TIME_ENCODING)
        check_int(name("threads"), self.threads, lo=0, hi=MAX_THREADS)
        for f in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs"):
            check_int(name(f), getattr(self, f), lo=1)
        for f in _BOOL_FIELDS:
            check_bool(name(f), getattr(self, f))
        check_bool_or_auto(name("prev_action"), self.prev_action)
        if self.async_start_method is not None:
            import multiprocessing

            methods = multiprocessing.get_all_start_methods()
            if self.async_start_method not in methods:
                raise ValueError(f"PPOConfig.async_start_method must be None or one of {methods}, "
                                 f"got {self.async_start_method!r}")
        for f in ("env_id", "exp_name", "runs_dir", "checkpoint_dir"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v:
                raise ValueError(f"PPOConfig.{f} must be a non-empty string, got {v!r}")
        if "/" in self.exp_name or "\\" in self.exp_name or self.exp_name in (".", ".."):
            raise ValueError(f"PPOConfig.exp_name is part of one folder name: expected no path separator, got "
                             f"{self.exp_name!r}")
        if self.device not in _DEVICES and not (isinstance(self.device, str) and self.device.startswith("cuda:")
                                                and self.device[5:].isdigit()):
            raise ValueError(f"PPOConfig.device must be one of {_DEVICES} or 'cuda:N' (N >= 0), got {self.device!r}")
        check_choice(name("dtype"), self.dtype, _DTYPES)
        check_choice(name("nonfinite"), self.nonfinite, _NONFINITE)
        check_choice(name("backend"), self.backend, _BACKENDS)
        check_choice(name("env_backend"), self.env_backend, _ENV_BACKENDS)
        check_choice(name("env_overlap"), self.env_overlap, _ENV_OVERLAP)
        if self.env_overlap == "on" and (self.env_backend != "envpool" or self.num_envs < 2):
            raise ValueError(f"{name('env_overlap')} 'on' steps two EnvPool pools of half the envs each; expected "
                             f"env_backend 'envpool' and num_envs >= 2 (or env_overlap 'auto' / 'off'), got "
                             f"env_backend {self.env_backend!r} and num_envs {self.num_envs}")
        if self.env_backend == "envpool" and (self.async_envs or self.capture_video):
            what = "async_envs" if self.async_envs else "capture_video"
            raise ValueError(f"{name('env_backend')} 'envpool' runs its envs in EnvPool's own thread pool and records no "
                             f"video; expected {what}=False (or env_backend 'gymnasium' / 'auto'), got {what}=True")
        if self.joint_action and self.env_backend == "envpool":
            raise ValueError(f"{name('joint_action')} wraps each gymnasium env; expected env_backend 'gymnasium' or "
                             f"'auto', got 'envpool'")
        if self.num_envs % self.num_minibatches != 0:
            raise ValueError(
                f"PPOConfig.num_envs ({self.num_envs}) must be divisible by num_minibatches "
                f"({self.num_minibatches}): minibatches are fixed-shape slices over envs"
            )
        for f, lo, hi, lo_open, optional in _REAL_FIELDS:
            check_real(name(f), getattr(self, f), lo, hi, lo_open=lo_open, optional=optional)
        if self.total_timesteps < self.batch_size:
            raise ValueError(
                f"PPOConfig.total_timesteps ({self.total_timesteps}) must be >= one rollout "
                f"num_envs*num_steps = {self.batch_size}"
            )

    @property
    def batch_size(self) -> int:
        """Env steps per rollout: num_envs * num_steps."""
        return self.num_envs * self.num_steps

    @property
    def envs_per_minibatch(self) -> int:
        """Rows (envs) of each minibatch: num_envs // num_minibatches."""
        return self.num_envs // self.num_minibatches

    @property
    def num_updates(self) -> int:
        """Updates in the run: ceil(total_timesteps / batch_size), so the run covers at least
        total_timesteps env steps (exactly :attr:`planned_timesteps`)."""
        return -(-self.total_timesteps // self.batch_size)

    @property
    def planned_timesteps(self) -> int:
        """Env steps the run will take: num_updates * batch_size (>= total_timesteps)."""
        return self.num_updates * self.batch_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of all fields; ``backbone`` is a nested dict (MambaConfig.to_dict)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["backbone"] = self.backbone.to_dict()
        return d


class PPOConfig(_PPOFields):
    """Hyperparameters of :class:`mamba_rl.agents.RecurrentPPO`.

    The defaults are CleanRL's PPO (Huang et al. 2022) with eight changes measured on the memory tasks
    (benchmarks/learning/README.md, the 2026-12-04 and 2026-12-05 sweeps: CartPoleNoVel 25 of 25 seeds >= 475 at
    100k steps against 2 of 10 before, PendulumNoVel 8 of 8 >= -200 at 150k): learning rate 2e-3 annealed to 0,
    3 epochs of 4 minibatches that stop early once approx_kl exceeds 0.02 (``target_kl``), no entropy bonus,
    advantages not normalised per minibatch,
    observations with a continuous part normalised with statistics frozen after 20,000 env steps, rewards scaled
    (NormalizeReward), and the previous action as input for discrete actions and where the env declares that its
    observation needs it (``prev_action="auto"``, :func:`mamba_rl.agents.policy.prev_action_input`: POPGym's
    NoisyPositionOnlyCartPoleEasy 0.673 -> 0.894 and MultiarmedBanditEasy 0.155 -> 0.363 MMER at 200k, 6 seeds
    each; off for Box actions, where it cost PendulumNoVel 40 of return).
    On POPGym's all-discrete tasks ``norm_adv=True`` (``--norm-adv``) scored higher (MultiarmedBanditEasy 0.240 vs
    0.155, ConcentrationEasy -0.150 vs -0.166 MMER at 200k, 6 seeds each) and on its Box tasks lower (Noisy
    PositionOnly CartPole 0.646 vs 0.673, PositionOnly Pendulum 0.846 vs 0.886, 3 seeds each).

    Attributes (units in brackets; each line is also the field's ``mamba-rl train --help`` text):
        env_id: any id gymnasium.make accepts: registered (CartPole-v1), mamba_rl/...NoVel, popgym-..., or module:EnvId (list them: mamba-rl envs).
        exp_name: experiment name, part of the run folder name.
        seed: seed of envs (sub-env i gets seed + i), weights, sampling and minibatch order.
        total_timesteps: env steps to train for, all envs (of all ranks) together [steps]; at least one rollout, rounded up to whole rollouts of num_envs * num_steps.
        device: "auto" (cuda if available else cpu), "cpu", "cuda" or "cuda:N".
        dtype: backbone compute dtype, "f32" | "tf32" (float32 with TF32 tensor-core GEMMs on CUDA, an opt-in) | "bf16" | "f16".
        backend: backbone backend, "auto" | "cuda" | "cpu" | "reference" (auto: the kernels of the device).
        cuda_graphs: capture the stepper and trainer in CUDA graphs (CUDA only).
        num_envs: parallel envs; must be divisible by num_minibatches. Per rank in a data-parallel run
            (torchrun / ``mamba-rl train --nproc N``: N * num_envs envs in all; mamba_rl.agents.distributed).
        num_steps: steps per env per rollout, the BPTT length [steps].
        async_envs: one process per env (gymnasium AsyncVectorEnv).
        async_start_method: with async_envs, the workers' multiprocessing start method: fork | spawn | forkserver (None: the platform's default).
        env_backend: vector env: "gymnasium" (SyncVectorEnv / AsyncVectorEnv), "envpool" (EnvPool's C++ thread pool, same semantics; pip install -e ".[envpool]"; its ids and the mamba_rl/*NoVel* ids of its tasks; no async_envs or video) or "auto" (envpool when installed and it has the id, else gymnasium).
        env_overlap: step the envs in two halves, acting on one half while the other half's EnvPool pool steps (mamba_rl.envs.parts): "on" (needs env_backend "envpool" and >= 2 envs), "off", or "auto" (on with EnvPool from 1,024 envs: OVERLAP_MIN_ENVS). Per env the same semantics; the trajectories differ from "off": the first half of each step is normalised with running statistics that do not hold the second half's rows yet (a difference of order 1 / their count: large in the first steps, ~1e-5 after a thousand), and the action sampling draws per half (on CUDA; on the CPU for Box actions from 16 envs on).
        threads: torch CPU threads of this process, set before the model is built; 0 = auto: $OMP_NUM_THREADS when set, else 1, so that N runs on N cores never oversubscribe the machine.
        learning_rate: initial lr of backbone AdamW and head Adam.
        anneal_lr: decay both lrs linearly to 0 over the run.
        replan_lr: when a resumed run's horizon changes (a larger total_timesteps), re-plan the anneal over the new horizon from the initial lr (the lr jumps); by default the anneal continues from the current lr to 0 at the new end.
        adam_eps: epsilon of both optimizers.
        weight_decay: backbone AdamW weight decay (0 = Adam, as CleanRL).
        gamma: discount factor; 0.9 with gae_lambda 0.65 suits POPGym's discrete card / bandit tasks, not cart-poles.
            Measured at 200k env steps (benchmarks/learning/README.md, 2026-12-05): on POPGym's all-discrete tasks
            gamma 0.9 with gae_lambda 0.65 learned Concentration and the bandit far faster than the default 0.99 /
            0.95, and broke the cart-poles, whose 500-step episodes need the longer horizon: a per-task choice.
        gae_lambda: GAE lambda (Schulman et al. 2016); see gamma.
        aux_gamma: discount of a second critic head, the two-horizon critic (0.0 by default; None: off); in [0, 1].
            The aux head (a linear layer on the same features, CleanRL's init gain 1) learns V at ``aux_gamma`` with
            its own GAE(aux_gamma, aux_gae_lambda) (Schulman et al. 2016); its value loss, of the main critic's form
            (``clip_vloss``, ``vf_coef``), is added to the main one, whose returns and values do not change. At
            ``aux_gamma`` 0 the aux head learns the expected immediate reward and A_aux = r_t - V_aux(s_t) (lambda
            plays no part): per-step credit for each action, beside the main critic's long horizon. The policy's
            advantage is ``A + C * A_aux`` with C = ``aux_adv_add`` (both in the reward's units), or, with
            ``aux_adv_add=None``, ``(1 - w) * A + w * A_aux * std(A) / std(A_aux)`` with w = ``aux_adv_weight``, both
            stds over the rollout's valid steps (all ranks'; A alone where std(A_aux) is ~0).
            Measured on the CPU (benchmarks/learning/README.md, 3 seeds at 200k env steps): the default (aux_gamma
            0, C 6) gives 6 of 8 POPGym bars and +0.114 over sb3-contrib's LSTM (ConcentrationEasy +0.135,
            AutoencodeEasy -0.426), CartPoleNoVel >= 475 within 100k steps on 10 of 10 seeds, PendulumNoVel >= -200
            on 3 of 3; C 8 reached AutoencodeEasy's bar (-0.414) but CartPoleNoVel's on 7 of 10 seeds. The previous default
            (aux_gamma 0.9, aux_gae_lambda 0.65, the rescaled mix at w 0.3): 6 of 8 and +0.085. The rescaled mix
            at aux_gamma 0 breaks CartPoleNoVel (a reward of 1 every step leaves A_aux only the critic's error,
            which the rescaling blows up to A's size: MMER 20-54 at w 1); the additive form leaves it at its own
            size. Costs one more head column (~5 % SPS on the GPU loop at 8 envs).
        aux_gae_lambda: GAE lambda of the aux critic's advantages and returns (with aux_gamma; ignored without); [0, 1].
        aux_adv_weight: weight w of the rescaled mix (with aux_gamma and ``aux_adv_add=None``; ignored otherwise);
            [0, 1].
        aux_adv_add: C in ``A + C * A_aux``, the aux advantage added in the reward's units (with aux_gamma; ignored
            without); in [0, 1000], or None for the rescaled mix (``aux_adv_weight``). The bound keeps the loss and
            its gradient finite in float32 (at 1e20 every minibatch step overflows and is skipped, so nothing
            trains). A checkpoint from before this field resumes with None, the mix it trained with.
        num_minibatches: minibatches per epoch; each is [num_envs/num_minibatches, num_steps].
        update_epochs: passes over the rollout per update.
        norm_adv: normalise advantages per minibatch (over valid steps); off by default.
            With [2, 128] minibatches the normalisation blew value noise up to unit scale once episodes were
            truncated (benchmarks/learning/README.md).
        clip_coef: PPO ratio clip (Schulman et al. 2017).
        clip_vloss: clip the value loss too.
        ent_coef: entropy bonus weight.
        vf_coef: value-loss weight.
        max_grad_norm: one global clip over heads + backbone (None: no clip).
        target_kl: stop the epochs of an update once approx_kl exceeds it (None: never).
            0.02 by default: with it and 3 epochs every POPGym task's seed spread stayed <= 0.070 and
            CartPoleNoVel's seeds 1-5 within 11 of return, at the same means (benchmarks/learning/README.md,
            2026-12-05).
        max_minibatch_kl: skip an update's remaining minibatch steps from the first minibatch whose approx_kl,
            measured before its step, exceeds it (stable-baselines3's per-minibatch early stop, there at 1.5 x
            target_kl); None (the default): never. A skipped step leaves the weights, both optimizers' moments and
            the f16 loss scale as they were; the update's untaken steps are logged as
            ``losses/kl_stopped_steps``. On CUDA the test runs on the device inside the captured minibatch (no host
            sync); on the CPU the update ends at the stop. On a deterministic late collapse of PositionOnlyCartPole (one failed episode after 2M steps of
            perfect ones, the critic's explained variance at -3, the return 1.0 -> 0.16) 0.03 and 0.05 kept the
            return >= 0.996, 0.10 and 0.15 did not; at 200k steps 0.05 binds often and left AutoencodeEasy at
            -0.417 (-0.415 without), so it is off by default (benchmarks/learning/README.md, 2026-12-06).
        min_action_std: the smallest std of a Box action's Gaussian, as a fraction of its half-range (0: off).
            The half-range is ``(high - low) / 2`` per action dimension (1 where a bound is infinite); [0, 1]. After
            every head step the state-independent ``log_std`` is raised to ``log(min_action_std * half-range)``
            where it fell below (a projection, as SAC's log-std clamp and DreamerV1's ``min_std``). 0.2 by default:
            without it a PositionOnlyPendulum run's std shrank to 0.25 by 3M steps, where one update's
            approx_kl reached 13 and the return fell from 0.90 to 0.11 for good; with the floor the same resumed
            run held 0.89-0.91 (benchmarks/learning/README.md, 2026-12-05). At 200k steps the std stays above it.
        action_set_coef: weight C of the action-set loss (0: off; in [0, 1000]; discrete actions only). An auxiliary
            head (a linear layer on the backbone's features, CleanRL's init gain 1, ``heads["action_set"]``)
            predicts at every step which actions the agent has already taken in this episode: one logit per action
            (per joint action of a MultiDiscrete space, at most 4,096), trained with binary cross-entropy against
            that multi-hot set (the mean over actions and over the steps whose episode began inside the rollout;
            :func:`mamba_rl.agents.loss.action_set_loss`), its gradient into the backbone too; ``C * loss`` is
            added to the PPO loss. Self-supervised memory shaping, in the line of UNREAL's auxiliary tasks
            (Jaderberg et al. 2017): the backbone is taught to keep the set the policy needs for "no action
            twice" tasks, which 200k steps of reward alone did not teach it. The acting path never computes the
            head. Measured at 200k steps on the CPU, 6 seeds each (benchmarks/learning/README.md, 2026-12-07): C 10
            lifted POPGym's BattleshipEasy (with ``joint_action``) from -0.414 to -0.254 and ConcentrationEasy from
            0.153 to 0.256, and cost AutoencodeEasy 0.06 (3 seeds; it has no set to keep): a per-task choice, off by
            default.
        anneal_action_set: scale the action-set weight linearly down to 0 over the run, by the lr anneal's
            fraction (``RecurrentPPO.anneal_fraction``: CleanRL's ``1 - (update - 1) / num_updates``), whether or
            not ``anneal_lr`` is on; with ``action_set_coef`` (ignored at 0). Off by default. At 200k steps (CPU,
            benchmarks/learning/README.md, 2026-12-07) it lifted ConcentrationEasy at C 10 from 0.256 to 0.310 (6
            seeds) and left BattleshipEasy within its seed noise (-0.280 vs -0.262, 3 seeds).
        joint_action: a MultiDiscrete action space becomes one Discrete over every combination (at most 4,096;
            :class:`mamba_rl.envs.JointAction`), so the policy's categorical can put its mass on any set of
            combinations (Battleship's "any cell not yet shot"), which a product of per-component categoricals
            cannot. The envs are built with the wrapper (gymnasium backend only), ``evaluate`` and ``predict``
            take the joint action's space too.
        backbone: the backbone's :class:`mamba_rl.MambaConfig` (every field of it, dt_rank and
            rms_norm_eps included, reaches the backbone): the one place its values live, read as
            ``config.backbone.d_model``. Its fields may also be given flat: ``PPOConfig(d_model=64)`` /
            ``replace(d_state=8)`` set them inside ``backbone`` (``--d-model 64`` on the command line).
        prev_action: append the previous action (one-hot when discrete, clipped for Box; zero at an episode start) to the input: True, False or "auto" (on the command line on, off or auto; on for Discrete / MultiDiscrete actions and where the env declares ``obs_requires_prev_action``, as POPGym's MultiarmedBandit, Battleship and Concentration do; off for other Box-action envs: mamba_rl.agents.policy.prev_action_input).
        prev_reward: append the previous reward (as training scales it; 0 at an episode start) to the input. On by
            default: at 200k steps it lifted AutoencodeEasy from -0.426 to -0.419 (12 seeds), the bandit from 0.432
            to 0.460 and PositionOnlyPendulum from 0.870 to 0.887, and left every other POPGym task and
            CartPoleNoVel at or above its earlier figures (benchmarks/learning/README.md, 2026-12-06). ``predict``
            then needs the last reward (``reward=``).
        time_encoding: K >= 1 appends the in-episode step t of the observation (0 at an episode's first) to the
            input as K sinusoid pairs, sin / cos(2 pi t / P) for the periods P = 4, 8, ..., 2^(K + 1) steps (the
            positional encoding of Vaswani et al. 2017, "Attention is all you need", section 3.5, of the agent's
            own step count, reset with the memory at every episode start; :func:`mamba_rl.agents.policy.time_features`).
            0 (off) or 1..16.
        normalize_obs: running mean/std observation normalisation (gymnasium NormalizeObservation) of the flattened observations: of every observation space with ``obs_norm_discrete`` (the default), else only of spaces with a continuous part (:func:`mamba_rl.envs.make_vec_env`).
        obs_norm_discrete: with normalize_obs (ignored without it), normalise all-discrete observation spaces
            too (their flattened one-hot codes), as sb3's VecNormalize does with every observation. On by default:
            at 200k steps it lifted AutoencodeEasy from -0.418 to -0.410 (24 seeds each) and ConcentrationEasy
            from 0.134 to 0.153, cost MultiarmedBanditEasy 0.040 (still +0.2 over the LSTM) and left
            RepeatPrevious and Battleship as they were; observations with a continuous part are normalised
            either way (benchmarks/learning/README.md, 2026-12-06). False is the continuous-only rule.
        obs_norm_freeze_steps: with normalize_obs (ignored without it), the env step [all ranks] after which the normaliser's mean / std stop updating (0: never); a frozen normaliser removed the late collapses of CartPoleNoVel runs (benchmarks/learning/README.md).
        normalize_reward: scale rewards by the running std of the discounted return (gymnasium NormalizeReward).
            On by default, unlike CleanRL's discrete PPO: actor and critic share the backbone,
            and unscaled value targets (O(100) on CartPole) dominate the one global gradient
            norm, starving the policy (measured: CartPole-v1 collapses back to ~50 without it).
        memoryless: reset the recurrent state at every step (ablation baseline).
        nonfinite: a NaN/inf observation or reward from an env: "raise" (an error naming the env and the step) or "zero" (replaced by 0, counted in TensorBoard as env/nonfinite_obs and env/nonfinite_rewards).
        capture_video: record videos of env 0 under {runs_dir}/{run_name}/videos.
        runs_dir: parent of the TensorBoard run folders.
        track: write TensorBoard logs.
        checkpoint_dir: parent of the checkpoint folders (one per run).
        checkpoint_every: save every this many updates (0: only at the end / on Ctrl-C).

    Raises:
        ValueError: naming the field, the expected range and the received value.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(_PPOFields)} - set(BACKBONE_FIELDS)
        if unknown:
            raise ValueError(f"PPOConfig: unknown fields {sorted(unknown)}; expected PPOConfig's fields "
                             f"{[f.name for f in dataclasses.fields(_PPOFields)]} or the backbone's "
                             f"{list(BACKBONE_FIELDS)}")
        flat = {k: kwargs.pop(k) for k in BACKBONE_FIELDS if k in kwargs}
        if flat:  # into the backbone given (positionally or by name), else the default one
            bound = inspect.signature(_PPOFields).bind_partial(*args, **kwargs)
            base = bound.arguments.get("backbone", MambaConfig())
            if not isinstance(base, MambaConfig):
                raise ValueError(f"PPOConfig.backbone must be a MambaConfig, got {type(base).__name__}")
            bound.arguments["backbone"] = dataclasses.replace(base, **flat)
            args, kwargs = bound.args, bound.kwargs
        super().__init__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only for names that are not attributes
        if name in BACKBONE_FIELDS:
            raise AttributeError(f"PPOConfig has no attribute {name!r}: the backbone's fields live in "
                                 f"config.backbone (read config.backbone.{name}; set it with "
                                 f"PPOConfig({name}=...) or replace({name}=...))")
        raise AttributeError(f"'PPOConfig' object has no attribute {name!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PPOConfig:
        """Inverse of :meth:`to_dict`. Also reads the flat backbone fields of older checkpoints
        (``d_model``, ``n_layers``, ...), a dict without ``aux_gamma`` (a checkpoint from before the
        two-horizon critic, which had no aux head) as ``aux_gamma=None``, one without ``aux_adv_add`` (from
        before the additive form) as ``aux_adv_add=None``, one without ``time_encoding`` as 0 (none) and one without
        ``obs_norm_discrete`` as False. Raises ValueError on unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)} | set(BACKBONE_FIELDS)
        extra = set(d) - known
        if extra:
            raise ValueError(f"PPOConfig: unknown fields {sorted(extra)}; expected a subset of {sorted(known)}")
        d = dict(d)
        d.setdefault("aux_gamma", None)
        d.setdefault("aux_adv_add", None)  # before the additive form: the rescaled mix
        d.setdefault("time_encoding", 0)  # before the time encoding: none
        d.setdefault("obs_norm_discrete", False)  # before the flag: the continuous-only rule
        if isinstance(d.get("backbone"), dict):
            d["backbone"] = MambaConfig.from_dict(d["backbone"])
        return cls(**d)

    def replace(self, **changes: Any) -> PPOConfig:
        """A validated copy with ``changes`` applied; flat backbone fields change ``backbone``."""
        return dataclasses.replace(self, **changes)
