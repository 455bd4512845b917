"""PPOConfig: every hyperparameter of the recurrent PPO agent, validated at construction.

Defaults follow CleanRL's ``ppo.py`` / ``ppo_atari_lstm.py`` (Huang et al. 2022, "CleanRL"):
8 envs x 128 steps, gamma 0.99, GAE lambda 0.95, 4 minibatches, 4 epochs, clip 0.2 (also on the
value), entropy 0.01, value 0.5, max grad norm 0.5, Adam eps 1e-5, lr linearly annealed. Two
deliberate differences: rewards are scaled by gymnasium's NormalizeReward (``normalize_reward``)
because actor and critic share the backbone (see that field), and the lr starts at 1e-3, not 2.5e-4
(measured on CartPoleNoVel-v1, 3 seeds x 100k steps, benchmarks/learning/README.md: mean return of the
last 100 episodes 423 vs 368, deterministic evaluation 500 on every seed).
The backbone is a :class:`mamba_rl.MambaConfig` (field ``backbone``), with its defaults:
d_model 128, 3 layers, d_state 16, d_conv 4, expand 2, dt_rank "auto", rms_norm_eps 1e-5.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass, field
from typing import Any

from mamba_rl import MambaConfig

__all__ = ["PPOConfig", "BACKBONE_FIELDS"]

# MambaConfig's constructor fields, in the order of PPOConfig's init-only fields below;
# PPOConfig(...), replace(...) and from_dict(...) also take them flat (tests check it lists them all)
BACKBONE_FIELDS = ("d_model", "n_layers", "d_state", "d_conv", "expand", "dt_rank", "rms_norm_eps",
                   "layer", "headdim", "rope_fraction", "dt_min", "dt_max", "A_floor", "A_activation",
                   "is_outproj_norm")

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("f32", "bf16", "f16")
_BACKENDS = ("auto", "cuda", "cpu", "reference")


@dataclass
class PPOConfig:
    """Hyperparameters of :class:`mamba_rl.agents.RecurrentPPO`.

    Attributes (units in brackets; each line is also the field's ``mamba-rl train --help`` text):
        env_id: any id gymnasium.make accepts: registered (CartPole-v1), mamba_rl/...NoVel, popgym-..., or module:EnvId (list them: mamba-rl envs).
        exp_name: experiment name, part of the run folder name.
        seed: seed of envs (sub-env i gets seed + i), weights, sampling and minibatch order.
        total_timesteps: env steps to train for, all envs (of all ranks) together [steps]; at least one rollout, rounded up to whole rollouts of num_envs * num_steps.
        device: "auto" (cuda if available else cpu), "cpu", "cuda" or "cuda:N".
        dtype: backbone compute dtype, "f32" | "bf16" | "f16".
        backend: backbone backend, "auto" | "cuda" | "cpu" | "reference" (auto: the kernels of the device).
        cuda_graphs: capture the stepper and trainer in CUDA graphs (CUDA only).
        num_envs: parallel envs; must be divisible by num_minibatches. Per rank in a data-parallel run
            (torchrun / ``mamba-rl train --nproc N``: N * num_envs envs in all; mamba_rl.agents.distributed).
        num_steps: steps per env per rollout, the BPTT length [steps].
        async_envs: one process per env (gymnasium AsyncVectorEnv).
        async_start_method: with async_envs, the workers' multiprocessing start method: fork | spawn | forkserver (None: the platform's default).
        threads: torch CPU threads of this process, set before the model is built; 0 = auto: $OMP_NUM_THREADS when set, else 1, so that N runs on N cores never oversubscribe the machine.
        learning_rate: initial lr of backbone AdamW and head Adam.
        anneal_lr: decay both lrs linearly to 0 over the run.
        adam_eps: epsilon of both optimizers.
        weight_decay: backbone AdamW weight decay (0 = Adam, as CleanRL).
        gamma: discount factor.
        gae_lambda: GAE lambda (Schulman et al. 2016).
        num_minibatches: minibatches per epoch; each is [num_envs/num_minibatches, num_steps].
        update_epochs: passes over the rollout per update.
        norm_adv: normalise advantages per minibatch (over valid steps).
        clip_coef: PPO ratio clip (Schulman et al. 2017).
        clip_vloss: clip the value loss too.
        ent_coef: entropy bonus weight.
        vf_coef: value-loss weight.
        max_grad_norm: one global clip over heads + backbone (None: no clip).
        target_kl: stop the epochs of an update once approx_kl exceeds it (None: never).
        backbone: the backbone's :class:`mamba_rl.MambaConfig` (every field of it, dt_rank and
            rms_norm_eps included, reaches the backbone). Its fields may also be given flat:
            ``PPOConfig(d_model=64)`` / ``replace(d_state=8)`` set them inside ``backbone``.
        prev_action: append the previous action (one-hot when discrete) to the input.
        prev_reward: append the previous reward to the input.
        normalize_obs: running mean/std observation normalisation (gymnasium NormalizeObservation).
        normalize_reward: scale rewards by the running std of the discounted return (gymnasium NormalizeReward).
            On by default, unlike CleanRL's discrete PPO: actor and critic share the backbone,
            and unscaled value targets (O(100) on CartPole) dominate the one global gradient
            norm, starving the policy (measured: CartPole-v1 collapses back to ~50 without it).
        memoryless: reset the recurrent state at every step (ablation baseline).
        capture_video: record videos of env 0 under {runs_dir}/{run_name}/videos.
        runs_dir: parent of the TensorBoard run folders.
        track: write TensorBoard logs.
        checkpoint_dir: parent of the checkpoint folders (one per run).
        checkpoint_every: save every this many updates (0: only at the end / on Ctrl-C).

    Raises:
        ValueError: naming the field, the expected range and the received value.
    """

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
    threads: int = 0
    learning_rate: float = 1e-3
    anneal_lr: bool = True
    adam_eps: float = 1e-5
    weight_decay: float = 0.0
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float | None = 0.5
    target_kl: float | None = None
    backbone: MambaConfig = field(default_factory=MambaConfig)
    prev_action: bool = False
    prev_reward: bool = False
    normalize_obs: bool = False
    normalize_reward: bool = True
    memoryless: bool = False
    capture_video: bool = False
    runs_dir: str = "runs"
    track: bool = True
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 50
    # flat backbone fields (None: keep backbone's); init-only, folded into ``backbone``
    d_model: InitVar[int | None] = None
    n_layers: InitVar[int | None] = None
    d_state: InitVar[int | None] = None
    d_conv: InitVar[int | None] = None
    expand: InitVar[int | None] = None
    dt_rank: InitVar[int | str | None] = None
    rms_norm_eps: InitVar[float | None] = None
    layer: InitVar[str | None] = None
    headdim: InitVar[int | None] = None
    rope_fraction: InitVar[float | None] = None
    dt_min: InitVar[float | None] = None
    dt_max: InitVar[float | None] = None
    A_floor: InitVar[float | None] = None
    A_activation: InitVar[str | None] = None
    is_outproj_norm: InitVar[bool | None] = None

    def __post_init__(self, *flat: Any) -> None:
        if not isinstance(self.backbone, MambaConfig):
            raise ValueError(f"PPOConfig.backbone must be a MambaConfig, got {type(self.backbone).__name__}")
        given = {name: v for name, v in zip(BACKBONE_FIELDS, flat) if v is not None}
        if given:
            self.backbone = dataclasses.replace(self.backbone, **given)

        def pos_int(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            lo = 0 if allow_zero else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"PPOConfig.{name} must be an int >= {lo}, got {v!r}")

        def real(name: str, lo: float, hi: float, lo_open: bool = False, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"PPOConfig.{name} must be a finite number, got {v!r}")
            if v < lo or v > hi or (lo_open and v == lo):
                rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
                raise ValueError(f"PPOConfig.{name} must be in {rng}, got {v!r}")

        for name in ("seed", "total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs"):
            pos_int(name, allow_zero=(name == "seed"))
        pos_int("checkpoint_every", allow_zero=True)
        pos_int("threads", allow_zero=True)
        if self.async_start_method is not None:
            import multiprocessing

            methods = multiprocessing.get_all_start_methods()
            if self.async_start_method not in methods:
                raise ValueError(f"PPOConfig.async_start_method must be None or one of {methods}, "
                                 f"got {self.async_start_method!r}")
        if not isinstance(self.env_id, str) or not self.env_id:
            raise ValueError(f"PPOConfig.env_id must be a non-empty string, got {self.env_id!r}")
        if self.device not in _DEVICES and not str(self.device).startswith("cuda:"):
            raise ValueError(f"PPOConfig.device must be one of {_DEVICES} or 'cuda:N', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"PPOConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"PPOConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.num_envs % self.num_minibatches != 0:
            raise ValueError(
                f"PPOConfig.num_envs ({self.num_envs}) must be divisible by num_minibatches "
                f"({self.num_minibatches}): minibatches are fixed-shape slices over envs"
            )
        real("learning_rate", 0.0, 1.0, lo_open=True)
        real("adam_eps", 0.0, 1.0, lo_open=True)
        real("weight_decay", 0.0, 1.0)
        real("gamma", 0.0, 1.0)
        real("gae_lambda", 0.0, 1.0)
        real("clip_coef", 0.0, math.inf, lo_open=True)
        real("ent_coef", 0.0, math.inf)
        real("vf_coef", 0.0, math.inf)
        real("max_grad_norm", 0.0, math.inf, lo_open=True, optional=True)
        real("target_kl", 0.0, math.inf, lo_open=True, optional=True)
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PPOConfig:
        """Inverse of :meth:`to_dict`. Also reads the flat backbone fields of older checkpoints
        (``d_model``, ``n_layers``, ...). Raises ValueError on unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)} | set(BACKBONE_FIELDS)
        extra = set(d) - known
        if extra:
            raise ValueError(f"PPOConfig: unknown fields {sorted(extra)}; expected a subset of {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("backbone"), dict):
            d["backbone"] = MambaConfig.from_dict(d["backbone"])
        return cls(**d)

    def replace(self, **changes: Any) -> PPOConfig:
        """A validated copy with ``changes`` applied; flat backbone fields change ``backbone``."""
        flat = {name: changes.pop(name, None) for name in BACKBONE_FIELDS}
        return dataclasses.replace(self, **changes, **flat)


def _backbone_reader(name: str) -> property:
    return property(lambda self: getattr(self.backbone, name),
                    doc=f"``backbone.{name}`` (read-only here; set it with ``replace({name}=...)``).")


# reading a flat backbone field gives the backbone's value (the init-only defaults would read None)
for _name in BACKBONE_FIELDS:
    setattr(PPOConfig, _name, _backbone_reader(_name))
del _name
