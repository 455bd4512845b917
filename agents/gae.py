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
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["compute_gae", "compute_gae_parallel", "gae_discount_matrix"]


def _check(rewards, values, terminations, truncations, valid, next_value, gamma, gae_lambda) -> None:
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
    if not (0.0 <= gamma <= 1.0 and 0.0 <= gae_lambda <= 1.0):
        raise ValueError(f"gamma and gae_lambda must be in [0, 1], got {gamma}, {gae_lambda}")


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
