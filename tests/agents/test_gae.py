"""GAE under gymnasium NextStep autoreset: hand-computed cases (gamma 0.9, lambda 0.8, gamma*lambda 0.72)."""

import pytest
import torch
from mamba_rl.agents import compute_gae

G, L = 0.9, 0.8


def _gae(rewards, values, term, trunc, valid, next_value):
    t = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731  one env
    return compute_gae(t(rewards), t(values), t(term, torch.bool), t(trunc, torch.bool), t(valid, torch.bool),
                       torch.tensor([next_value]), G, L)


def test_no_done_bootstraps_with_next_value():
    adv, ret = _gae([1, 1, 1, 1], [0.5, 0.4, 0.3, 0.2], [0] * 4, [0] * 4, [1] * 4, 0.1)
    # delta_t = 1 + 0.9 V_{t+1} - V_t = 0.86, 0.87, 0.88, 0.89 ; A_t = delta_t + 0.72 A_{t+1}
    expect = [2.27478272, 1.964976, 1.5208, 0.89]
    torch.testing.assert_close(adv[0], torch.tensor(expect), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret[0], torch.tensor(expect) + torch.tensor([0.5, 0.4, 0.3, 0.2]), rtol=0, atol=1e-6)


def test_termination_cuts_and_reset_step_is_not_a_transition():
    # t=1 terminates; t=2 is the NextStep reset step (obs = final obs, V=9 must be ignored,
    # reward 0, action ignored); t=3 is the first step of the next episode.
    adv, ret = _gae([1, 2, 0, 1], [0.5, 0.4, 9.0, 0.2], [0, 1, 0, 0], [0] * 4, [1, 1, 0, 1], 0.1)
    # A1 = 2 - 0.4 = 1.6 ; A0 = 0.86 + 0.72 * 1.6 = 2.012 ; A2 = 0 (masked) ; A3 = 1 + 0.09 - 0.2 = 0.89
    torch.testing.assert_close(adv[0], torch.tensor([2.012, 1.6, 0.0, 0.89]), rtol=0, atol=1e-6)
    assert ret[0, 2] == 0.0


def test_truncation_bootstraps_with_final_obs_value_and_cuts():
    # same, but t=1 is truncated: bootstrap with V(final obs) = 9.0 stored at the reset step
    adv, _ = _gae([1, 2, 0, 1], [0.5, 0.4, 9.0, 0.2], [0] * 4, [0, 1, 0, 0], [1, 1, 0, 1], 0.1)
    # A1 = 2 + 0.9 * 9 - 0.4 = 9.7 (no lambda-continuation into the next episode)
    # A0 = 0.86 + 0.72 * 9.7 = 7.844
    torch.testing.assert_close(adv[0], torch.tensor([7.844, 9.7, 0.0, 0.89]), rtol=0, atol=1e-5)


def test_next_episode_does_not_leak_into_previous():
    # the reset step's neighbours: changing the next episode's rewards leaves the done episode's advantages alone
    a1, _ = _gae([1, 2, 0, 1], [0.5, 0.4, 9.0, 0.2], [0, 1, 0, 0], [0] * 4, [1, 1, 0, 1], 0.1)
    a2, _ = _gae([1, 2, 0, 100], [0.5, 0.4, 9.0, 7.0], [0, 1, 0, 0], [0] * 4, [1, 1, 0, 1], 3.0)
    torch.testing.assert_close(a1[0, :3], a2[0, :3])


def test_done_on_last_step_uses_next_value():
    # truncation at the last step: next_value is V(final obs) computed with the pre-reset state
    adv, _ = _gae([1, 1], [0.5, 0.4], [0, 0], [0, 1], [1, 1], 5.0)
    torch.testing.assert_close(adv[0], torch.tensor([0.86 + 0.72 * 5.1, 1 + 4.5 - 0.4]), rtol=0, atol=1e-5)
    # termination at the last step: no bootstrap at all
    adv, _ = _gae([1, 1], [0.5, 0.4], [0, 1], [0, 0], [1, 1], 5.0)
    torch.testing.assert_close(adv[0], torch.tensor([0.86 + 0.72 * 0.6, 0.6]), rtol=0, atol=1e-6)


def test_reset_step_at_rollout_start_is_masked():
    # the previous rollout ended with a done: column 0 is the reset step
    adv, ret = _gae([0, 1, 1], [3.0, 0.5, 0.4], [0] * 3, [0] * 3, [0, 1, 1], 0.0)
    assert adv[0, 0] == 0.0 and ret[0, 0] == 0.0
    torch.testing.assert_close(adv[0, 1:], torch.tensor([1 + 0.36 - 0.5 + 0.72 * 0.6, 0.6]), rtol=0, atol=1e-6)


def test_envs_are_independent_rows():
    r = torch.tensor([[1.0, 1.0], [0.0, 5.0]])
    v = torch.zeros(2, 2)
    f = torch.zeros(2, 2, dtype=torch.bool)
    adv, _ = compute_gae(r, v, f, f, ~f, torch.zeros(2), G, L)
    torch.testing.assert_close(adv, torch.tensor([[1 + 0.72, 1.0], [0.72 * 5, 5.0]]))


def test_bad_inputs_raise_with_names():
    r = torch.zeros(2, 3)
    b = torch.zeros(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="values must have shape"):
        compute_gae(r, torch.zeros(2, 4), b, b, b, torch.zeros(2), G, L)
    with pytest.raises(ValueError, match="terminations must be bool"):
        compute_gae(r, r, r, b, b, torch.zeros(2), G, L)
    with pytest.raises(ValueError, match="next_value must have shape"):
        compute_gae(r, r, b, b, b, torch.zeros(3), G, L)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(r, r, b, b, b, torch.zeros(2), 1.5, L)
