"""Generalised advantage estimation (Schulman et al. 2016) under gymnasium 1.x NextStep autoreset.

Layout: every tensor is batch-first, ``[num_envs, num_steps]`` (row n = env n, column t = step t
of the rollout), float32 on any device.

Why NextStep (gymnasium's default) and not SAME_STEP: under NextStep the final observation of
an episode comes back as an ordinary observation, so it passes through every vector wrapper
(NormalizeObservation included) and through the recurrent stepper with the episode's own,
pre-reset state. Its value V(final obs) is therefore computed by the rollout itself, exactly as
needed for bootstrapping a truncation. The price is one extra "reset step" per episode: the step
after a done, where the env ignores the action, returns the reset observation, reward 0 and
terminated = truncated = False. That step is not a transition of the MDP, so it is marked
invalid (``valid = False``) and carries no advantage, no return and no loss.

For a valid step t with done_t = terminated_t or truncated_t and V_T = ``next_value``:

    delta_t = r_t + gamma * (1 - terminated_t) * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
    R_t     = A_t + V_t                                (the value target)

* termination: no bootstrap, the recursion stops (GAE is cut only at terminations in the sense
  that only a termination drops the bootstrap value);
* truncation: V_{t+1} is the value of the step after, which under NextStep is the reset step
  holding the final observation and the pre-reset state, i.e. V(final obs); the recursion
  stops there too (the next episode's advantages belong to another trajectory);
* invalid (reset) steps get A = R = 0.

Two-horizon critic (``PPOConfig.aux_gamma``): a second value head gets its own GAE(aux_gamma,
aux_gae_lambda) advantages A_aux and returns from the same rewards and flags (the same functions, its own
values), and the policy's advantage combines the two: (:func:`add_advantages`) ``A = A_main + C A_aux`` in the
reward's units, or (:func:`combine_advantages`) the mix at the default advantage's scale
``A = (1 - w) A_main + w A_aux std(A_main) / std(A_aux)``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

__all__ = ["compute_gae", "compute_gae_parallel", "gae_discount_matrix", "advantage_moments", "combine_advantages",
           "add_advantages"]

# std(A_aux) at or below this: the aux advantage carries no signal and the policy's advantage is A_main alone
AUX_STD_EPS = 1e-8


def _require_tensors(prefix: str, **named) -> None:
    """ValueError naming the first of ``named`` that is not a torch.Tensor (``prefix`` leads the message)."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{prefix}{name} must be a torch.Tensor, got {type(t).__name__}")


def _check(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda) -> None:
    _require_tensors("", rewards=rewards, values=values, terminations=terminations, truncations=truncations,
                     valid=valid, next_value=next_value)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_envs, num_steps], got shape {tuple(rewards.shape)}")
    shape = rewards.shape
    for name, t in (("values", values), ("terminations", terminations),
                    ("truncations", truncations), ("valid", valid)):
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {tuple(shape)} like rewards, got {tuple(t.shape)}")
    for name, t in (("terminations", terminations), ("truncations", truncations), ("valid", valid)):
        if t.dtype != torch.bool:
            raise ValueError(f"{name} must be bool, got {t.dtype}")
    if next_value.shape != shape[:1]:
        raise ValueError(f"next_value must have shape ({shape[0]},), got {tuple(next_value.shape)}")
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= v <= 1.0
               for v in (gamma, gae_lambda)):
        raise ValueError(f"gamma and gae_lambda must be real numbers in [0, 1], got {gamma!r}, {gae_lambda!r}")


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    terminations: torch.Tensor,
    truncations: torch.Tensor,
    valid: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) advantages and value targets for one rollout.

    Args:
        rewards: [N, T] float, reward of the env step taken at t.
        values: [N, T] float, V(obs_t) computed in the rollout.
        terminations: [N, T] bool, the env step at t terminated the episode.
        truncations: [N, T] bool, the env step at t truncated the episode.
        valid: [N, T] bool, False at NextStep reset steps (the step after a done).
        next_value: [N] float, V of the observation after the rollout (computed with the
            carried state; equals V(final obs) when the last step was a done).
        gamma: discount in [0, 1]. gae_lambda: lambda in [0, 1].

    Returns:
        (advantages, returns): two [N, T] float32 tensors, zero where ``valid`` is False.

    Raises:
        ValueError: mismatched shapes or dtypes (names the tensor, expected and received).
    """
    _check(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda)
    ts = (rewards, values, terminations, truncations, valid, next_value)
    # the numpy loop for CPU tensors, unless autograd is to record the computation (numpy() refuses a tensor that
    # requires grad; the torch loop returns advantages / returns differentiable in values and next_value)
    if all(x.device.type == "cpu" for x in ts) and not (torch.is_grad_enabled() and any(x.requires_grad for x in ts)):
        return _compute_gae_host(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda)
    return _compute_gae_torch(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda)


def _compute_gae_torch(rewards, values, terminations, truncations, valid, next_value, gamma: float,
                       gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_gae`'s loop over steps in torch ops (any device)."""
    shape = rewards.shape
    n, t_len = shape
    rewards = rewards.float()
    values = values.float()
    not_term = (~terminations).float()
    not_done = (~(terminations | truncations)).float()
    validf = valid.float()
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(n, dtype=torch.float32, device=rewards.device)
    for t in reversed(range(t_len)):
        v_next = next_value.float() if t == t_len - 1 else values[:, t + 1]
        delta = rewards[:, t] + gamma * not_term[:, t] * v_next - values[:, t]
        last = (delta + gamma * gae_lambda * not_done[:, t] * last) * validf[:, t]
        advantages[:, t] = last
    returns = (advantages + values) * validf
    return advantages, returns


def _compute_gae_host(rewards, values, terminations, truncations, valid, next_value, gamma: float,
                      gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_gae`'s loop in numpy on time-major copies, for CPU tensors: the same float32 operations
    in the same order (torch multiplies a float32 tensor by a python float as by that float rounded to
    float32, as ``np.float32(gamma)`` does here; + - * round alike), so the results are bit for bit the torch
    loop's, at a fraction of its per-op cost (8 envs: ~6 numpy ops of 1 us per step instead of torch ops)."""
    r = rewards.float().numpy().T.copy()
    v = values.float().numpy().T.copy()
    not_term = (~terminations).float().numpy().T.copy()
    not_done = (~(terminations | truncations)).float().numpy().T.copy()
    validf = valid.float().numpy().T.copy()
    t_len, n = r.shape
    g = np.float32(gamma)
    gl = np.float32(gamma * gae_lambda)  # python's product, then one rounding (torch's scalar cast)
    adv = np.zeros((t_len, n), dtype=np.float32)
    last = np.zeros(n, dtype=np.float32)
    nv = next_value.float().numpy()
    tmp = np.empty(n, dtype=np.float32)
    # inf / NaN as the torch loop gives them (an overflowing return is inf, 0 * inf NaN), without numpy's
    # floating-point warnings, which torch does not raise (and -W error would turn into exceptions)
    with np.errstate(all="ignore"):
        for t in range(t_len - 1, -1, -1):
            v_next = nv if t == t_len - 1 else v[t + 1]
            np.multiply(not_term[t], g, out=tmp)
            np.multiply(tmp, v_next, out=tmp)
            delta = np.add(r[t], tmp)
            np.subtract(delta, v[t], out=delta)
            np.multiply(not_done[t], gl, out=tmp)
            np.multiply(tmp, last, out=tmp)
            np.add(delta, tmp, out=delta)
            np.multiply(delta, validf[t], out=last)
            adv[t] = last
        returns = (adv + v) * validf
    return torch.from_numpy(adv.T.copy()), torch.from_numpy(returns.T.copy())


def gae_discount_matrix(num_steps: int, gamma: float, gae_lambda: float, device=None) -> torch.Tensor:
    """[T, T] float32 with (gamma lambda)^(s - t) at s >= t and 0 below the diagonal (0^0 = 1): the
    constant of :func:`compute_gae_parallel`, built once per config."""
    idx = torch.arange(num_steps, device=device, dtype=torch.float32)
    diff = idx.view(1, -1) - idx.view(-1, 1)  # [t, s] = s - t
    base = torch.full((), gamma * gae_lambda, dtype=torch.float32, device=device)
    return torch.where(diff >= 0, torch.pow(base, diff.clamp_min(0)), torch.zeros((), device=device))


def compute_gae_parallel(rewards: torch.Tensor, values: torch.Tensor, terminations: torch.Tensor,
                         truncations: torch.Tensor, valid: torch.Tensor, next_value: torch.Tensor, gamma: float,
                         gae_lambda: float, discount: torch.Tensor | None = None,
                         check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compute_gae` without the loop over steps: about ten kernels for any T, no host sync, so a
    CUDA graph can capture it (the GPU rollout does). Same arguments and results (up to float32 rounding:
    the sums run in another order).

    The recursion ``A_t = valid_t (delta_t + gamma lambda (1 - done_t) A_{t+1})`` unrolls to
    ``A_t = valid_t sum_{s >= t} (gamma lambda)^(s - t) [no done in t..s-1] delta_s``: an invalid step only
    follows a done (or opens the rollout), so inside a done-free stretch every step is valid. ``[no done
    in t..s-1]`` is "same segment", with segment ids = dones counted before each step. Memory: one
    [N, T, T] float32 temporary (64 MiB at 1024 envs x 128 steps).

    Args:
        as :func:`compute_gae`; ``discount``: :func:`gae_discount_matrix` for (T, gamma, lambda) on the
        rewards' device (built here when None); ``check``: validate the inputs (skip inside a capture).
    Raises:
        ValueError: as :func:`compute_gae`, or a ``discount`` of the wrong shape.
    """
    if check:
        _check(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda)
    t_len = rewards.shape[1]
    if discount is None:
        discount = gae_discount_matrix(t_len, gamma, gae_lambda, rewards.device)
    elif check and discount.shape != (t_len, t_len):
        raise ValueError(f"discount must be [{t_len}, {t_len}], got {tuple(discount.shape)}")
    values = values.float()
    v_next = torch.cat([values[:, 1:], next_value.float().view(-1, 1)], dim=1)
    delta = rewards.float() + gamma * (~terminations).float() * v_next - values
    done = (terminations | truncations).to(torch.int32)
    seg = torch.cumsum(done, dim=1) - done  # dones strictly before each step
    same = seg.unsqueeze(2) == seg.unsqueeze(1)  # [N, t, s]
    weights = torch.where(same, discount, torch.zeros((), device=rewards.device))
    validf = valid.float()
    advantages = (weights * delta.unsqueeze(1)).sum(-1) * validf
    returns = (advantages + values) * validf
    return advantages, returns


def _check_pair(who: str, advantages: torch.Tensor, aux_advantages: torch.Tensor, valid: torch.Tensor) -> None:
    """ValueError unless the two advantages and ``valid`` are tensors of one [N, T] shape and ``valid`` is bool."""
    _require_tensors(f"{who}: ", advantages=advantages, aux_advantages=aux_advantages, valid=valid)
    if advantages.shape != aux_advantages.shape or advantages.shape != valid.shape or advantages.dim() != 2:
        raise ValueError(f"{who}: expected advantages, aux_advantages and valid of one [N, T] shape, got "
                         f"{list(advantages.shape)}, {list(aux_advantages.shape)}, {list(valid.shape)}")
    if valid.dtype != torch.bool:
        raise ValueError(f"{who}: valid must be bool, got {valid.dtype}")


def advantage_moments(advantages: torch.Tensor, aux_advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[count, sum A, sum A^2, sum A_aux, sum A_aux^2] over the valid steps, float64 [5] on the inputs' device:
    what :func:`combine_advantages` takes its two standard deviations from. Sums, so that a data-parallel run
    adds them over the ranks (one all-reduce) and every rank mixes with the stds of all ranks' rollouts. No host
    sync (capturable).

    Args:
        advantages, aux_advantages: [N, T] float (the main and the aux critic's GAE advantages).
        valid: [N, T] bool, False at the NextStep reset steps (left out).

    Raises:
        ValueError: tensors of different shapes, or a ``valid`` that is not bool.
    """
    _check_pair("advantage_moments", advantages, aux_advantages, valid)
    # a select, not a product: a NaN / inf at an invalid step stays out
    a = torch.where(valid, advantages.double(), 0.0)
    b = torch.where(valid, aux_advantages.double(), 0.0)
    m = valid.double()
    return torch.stack([m.sum(), a.sum(), (a * a).sum(), b.sum(), (b * b).sum()])


def combine_advantages(advantages: torch.Tensor, aux_advantages: torch.Tensor, valid: torch.Tensor, weight: float,
                       moments: torch.Tensor | None = None, eps: float = AUX_STD_EPS) -> torch.Tensor:
    """The two-horizon critic's policy advantage:
    ``A = (1 - w) * A_main + w * A_aux * std(A_main) / std(A_aux)`` at valid steps, 0 elsewhere.

    Each std is the population standard deviation over the rollout's valid steps (``valid``); their ratio is
    the same with the unbiased one. Rescaling A_aux to A_main's spread keeps the result in the default
    advantage's scale, so ``norm_adv`` off (the default) sees the scale it was tuned with, whatever the two
    discounts. Where std(A_aux) <= ``eps`` (no aux signal, e.g. a rollout without a reward change) the result
    is A_main itself. Both advantages are GAE (Schulman et al. 2016) estimates, each with its own critic,
    gamma and lambda (:func:`compute_gae`). No host sync (capturable).

    Args:
        advantages: [N, T] float32, A_main (the main critic's GAE advantages; 0 at invalid steps).
        aux_advantages: [N, T] float32, A_aux (the aux critic's; 0 at invalid steps).
        valid: [N, T] bool, the steps the stds run over.
        weight: w in [0, 1] (``PPOConfig.aux_adv_weight``).
        moments: :func:`advantage_moments` of the rollout (data-parallel: summed over the ranks); None
            computes them from these tensors.
        eps: the std(A_aux) at or below which A_main is returned.

    Returns:
        [N, T] float32 on the inputs' device.

    Raises:
        ValueError: ``weight`` outside [0, 1]; tensors of different shapes, or a non-bool ``valid``.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"combine_advantages: weight must be in [0, 1], got {weight!r}")
    if moments is None:
        moments = advantage_moments(advantages, aux_advantages, valid)
    count = moments[0].clamp_min(1.0)
    mean_a, mean_b = moments[1] / count, moments[3] / count
    std_a = (moments[2] / count - mean_a * mean_a).clamp_min(0.0).sqrt()
    std_b = (moments[4] / count - mean_b * mean_b).clamp_min(0.0).sqrt()
    ok = std_b > eps
    scale = torch.where(ok, std_a / torch.where(ok, std_b, 1.0), 0.0).float()
    w = torch.where(ok, torch.full_like(moments[0], float(weight)), 0.0).float()
    adv = advantages.float()
    mixed = (1.0 - w) * adv + w * (aux_advantages.float() * scale)
    return torch.where(valid, mixed, torch.zeros((), device=adv.device))


def add_advantages(advantages: torch.Tensor, aux_advantages: torch.Tensor, valid: torch.Tensor,
                   coef: float) -> torch.Tensor:
    """The two-horizon critic's policy advantage in additive form: ``A = A_main + coef * A_aux`` at valid steps,
    0 elsewhere, both in the reward's own units (``PPOConfig.aux_adv_add``). Unlike :func:`combine_advantages`
    it does not rescale A_aux to A_main's spread, so where the aux critic has nothing to say (a near-constant
    reward: A_aux is only its critic's error) the term stays that small. Both are GAE (Schulman et al. 2016)
    estimates with their own critic, gamma and lambda. No host sync (capturable).

    Args:
        advantages: [N, T] float32, A_main (0 at invalid steps).
        aux_advantages: [N, T] float32, A_aux.
        valid: [N, T] bool.
        coef: C >= 0.

    Returns:
        [N, T] float32 on the inputs' device.

    Raises:
        ValueError: ``coef`` negative or not finite; tensors not of one [N, T] shape, or a non-bool ``valid``.
    """
    if isinstance(coef, bool) or not isinstance(coef, numbers.Real) or not (math.isfinite(coef) and coef >= 0.0):
        raise ValueError(f"add_advantages: coef must be a finite real number >= 0, got {coef!r}")
    _check_pair("add_advantages", advantages, aux_advantages, valid)
    mixed = advantages.float() + coef * aux_advantages.float()
    return torch.where(valid, mixed, torch.zeros((), device=advantages.device))
