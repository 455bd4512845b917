"""The CPU host path of the agent is bit-identical to the torch code it replaced (issue 21, host side):

- FlatHeadAdam's host step equals torch.optim.Adam's CPU step bit for bit (any head shapes, a changing lr,
  a clip factor), and its checkpoint format is torch.optim.Adam's;
- categorical_ppo_grads (heads + PPO loss, backward by hand) equals ppo_loss + torch.autograd.grad bit for bit,
  ties of both maxima and clipped ratios / values included, with the two-horizon critic's aux head too;
- compute_gae's numpy loop equals the torch loop bit for bit;
- the whole eager CPU update equals the autograd + torch.optim.Adam update bit for bit (weights, optimizer
  state, metrics), over two rollouts of the same agent.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import numpy as np
from gymnasium import spaces

from mamba_rl.agents import PPOConfig
from mamba_rl.agents.head_optim import FlatHeadAdam
from mamba_rl.agents.heads import ActorHead, CriticHead
from mamba_rl.agents.loss import Minibatch, categorical_ppo_grads, ppo_loss


@pytest.mark.parametrize("shapes", [[(2, 128), (2,), (1, 128), (1,)], [(7, 33), (7,), (1, 33), (1,)],
                                    [(5, 17), (5,), (1, 17), (1,), (5,)]])
def test_flat_head_adam_host_step_is_torch_adam_bit_for_bit(shapes):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    qs = [torch.nn.Parameter(t.clone()) for t in init]
    flat = FlatHeadAdam(ps, lr=1e-3, eps=1e-5)
    ref = torch.optim.Adam(qs, lr=1e-3, eps=1e-5)
    for it in range(60):
        grads = [torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-6, 2, (), generator=g)) for s in shapes]
        clip = torch.rand((), generator=g) if it % 2 else None
        lr = 1e-3 * (1 - it / 60)
        flat.set_lr(lr)
        for grp in ref.param_groups:
            grp["lr"] = lr
        for q, gr in zip(qs, grads):
            q.grad = gr * clip if clip is not None else gr
        ref.step()
        if it % 3 == 0:  # the torch-style entry point (p.grad) takes the same path
            for p, gr in zip(ps, grads):
                p.grad = gr * clip if clip is not None else gr
            flat.step()
        else:
            flat.host_step(flat.flat_grad(grads), clip)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    sd, rd = flat.state_dict(), ref.state_dict()
    assert sd["param_groups"][0].keys() == rd["param_groups"][0].keys()
    for i in range(len(shapes)):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(sd["state"][i][k]), torch.as_tensor(rd["state"][i][k])), (i, k)


def test_flat_head_adam_host_step_checks_its_gradient():
    flat = FlatHeadAdam([torch.nn.Parameter(torch.zeros(3, 4))], lr=1e-3)
    with pytest.raises(ValueError, match=r"grad must be float32 \[12\], got torch.float32 \[11\]"):
        flat.host_step(torch.zeros(11))
    with pytest.raises(ValueError, match="got torch.float64"):
        flat.host_step(torch.zeros(12, dtype=torch.float64))


def _minibatch(actor, critic, y, g, n_act, aux=None):
    """A minibatch around the heads' own outputs: a third of the stored log-probs / values equal to the new ones
    (ratio 1, ties of both maxima), a third far off (clipped), the rest near; some steps masked out. With an
    ``aux`` critic head its stored values / returns likewise (their own pattern of ties and clipped steps)."""
    rows, t_len, _ = y.shape

    def offsets():
        kind = torch.randint(0, 3, (rows, t_len), generator=g)
        return torch.where(kind == 0, 0.0, torch.where(kind == 1, 0.7, 0.05)) * torch.sign(torch.randn(rows, t_len, generator=g))

    with torch.no_grad():
        actions = torch.randint(0, n_act, (rows, t_len, 1), generator=g).float()
        logp = torch.log_softmax(actor.linear(y), -1).gather(-1, actions.long()).squeeze(-1)
        value = critic(y)
        off = offsets()
        mb = Minibatch(actions=actions, logprobs=logp + off, values=value - off,
                       advantages=torch.randn(rows, t_len, generator=g), returns=value + torch.randn(rows, t_len, generator=g),
                       mask=(torch.rand(rows, t_len, generator=g) > 0.2).float())
        if aux is None:
            return mb
        aux_value, aux_off = aux(y), offsets()
        return dataclasses.replace(mb, aux_values=aux_value - aux_off,
                                   aux_returns=aux_value + 0.5 * torch.randn(rows, t_len, generator=g))


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("norm_adv,clip_vloss,dp,n_act,d", [(True, True, False, 2, 128), (False, True, False, 5, 16),
                                                           (True, False, False, 3, 32), (True, True, True, 2, 64)])
def test_categorical_ppo_grads_are_autograd_bit_for_bit(norm_adv, clip_vloss, dp, n_act, d, aux):
    g = torch.Generator().manual_seed(n_act * 100 + d)
    c = PPOConfig(norm_adv=norm_adv, clip_vloss=clip_vloss, ent_coef=0.03, vf_coef=0.7, clip_coef=0.2,
                  aux_gamma=0.9 if aux else None)
    actor, critic = ActorHead(d, spaces.Discrete(n_act), g), CriticHead(d, g)
    aux_head = CriticHead(d, g) if aux else None
    with torch.no_grad():  # non-trivial heads (the orthogonal init's actor gain is 0.01)
        actor.linear.weight.mul_(30.0)
        actor.linear.bias.normal_(generator=g)
        critic.linear.bias.normal_(generator=g)
        if aux:
            aux_head.linear.bias.normal_(generator=g)
    params = [actor.linear.weight, actor.linear.bias, critic.linear.weight, critic.linear.bias]
    names = ["actor.w", "actor.b", "critic.w", "critic.b"]
    if aux:
        params += [aux_head.linear.weight, aux_head.linear.bias]
        names += ["aux.w", "aux.b"]
    aux_lin = aux_head.linear if aux else None
    for trial in range(4):
        rows, t_len = 2, 64
        y = torch.randn(rows, t_len, d, generator=g)
        mb = _minibatch(actor, critic, y, g, n_act, aux_head)
        count = mb.mask.sum().clamp_min(1.0)
        adv_norm = (torch.tensor(0.3), torch.tensor(1.7)) if dp else None
        yg = y.clone().requires_grad_()
        # the update's order: actor, critic, then the aux critic
        loss, st = ppo_loss(c, actor(yg), critic(yg), mb, count, adv_norm, aux_head(yg) if aux else None)
        ref = torch.autograd.grad(loss, [yg] + params)
        out = torch.empty(rows * t_len, d)
        got = categorical_ppo_grads(c, y, actor.linear, critic.linear, mb, count, adv_norm, out=out, aux_critic=aux_lin)
        lean = categorical_ppo_grads(c, y, actor.linear, critic.linear, mb, count, adv_norm, losses=False,
                                     aux_critic=aux_lin)
        assert sorted(lean.stats) == ["clipfrac", "logratio"] and torch.equal(lean.d_features, out)
        assert got.d_features is out
        assert torch.equal(out.view_as(y), ref[0]), trial
        assert len(got.head_grads) == len(params)
        for name, a, b in zip(names, got.head_grads, ref[1:]):
            assert torch.equal(a, b), (trial, name)
        assert sorted(st) == sorted(got.stats) and ("aux_v" in st) == aux
        for k, v in st.items():
            assert torch.equal(got.stats[k], v.detach()), (trial, k)
        assert torch.equal(got.newvalue, critic(y).detach())
        if aux:
            assert torch.equal(got.aux_newvalue, aux_head(y).detach())
            assert st["aux_v"] > 0 and not torch.equal(ref[5], torch.zeros_like(ref[5]))
        else:
            assert got.aux_newvalue is None
        assert torch.equal(categorical_ppo_grads(c, y, actor.linear, critic.linear, mb, count, adv_norm,
                                                 aux_critic=aux_lin).d_features, out)


def test_categorical_ppo_grads_checks_its_inputs():
    actor, critic = ActorHead(8, spaces.Discrete(2)), CriticHead(8)
    y = torch.randn(2, 4, 8)
    mb = Minibatch(*(torch.zeros(2, 4, 1) if i == 0 else torch.zeros(2, 4) for i in range(6)))
    with pytest.raises(ValueError, match="contiguous float32"):
        categorical_ppo_grads(PPOConfig(), y.transpose(0, 1), actor.linear, critic.linear, mb, torch.tensor(1.0))
    with pytest.raises(ValueError, match="contiguous float32"):
        categorical_ppo_grads(PPOConfig(), y.double(), actor.linear, critic.linear, mb, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"the minibatch must be \[2, 5\] like the features, got mask \[2, 4\]"):
        categorical_ppo_grads(PPOConfig(), torch.randn(2, 5, 8), actor.linear, critic.linear, mb, torch.tensor(1.0))
    # the aux critic and the minibatch's aux columns go together
    aux = CriticHead(8)
    with pytest.raises(ValueError, match="got aux values given, minibatch aux_values None, aux_returns None"):
        categorical_ppo_grads(PPOConfig(), y, actor.linear, critic.linear, mb, torch.tensor(1.0), aux_critic=aux.linear)
    mb_aux = dataclasses.replace(mb, aux_values=torch.zeros(2, 4), aux_returns=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="got aux values None, minibatch aux_values given, aux_returns given"):
        categorical_ppo_grads(PPOConfig(), y, actor.linear, critic.linear, mb_aux, torch.tensor(1.0))
    with pytest.raises(ValueError, match="ppo_loss: the aux critic's values"):
        ppo_loss(PPOConfig(), actor(y), critic(y), mb_aux, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"the aux critic must map 8 features to 1 value, got 8 -> 2"):
        categorical_ppo_grads(PPOConfig(), y, actor.linear, critic.linear, mb_aux, torch.tensor(1.0),
                              aux_critic=torch.nn.Linear(8, 2))


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0)])
def test_compute_gae_on_the_host_is_the_torch_loop_bit_for_bit(gamma, lam):
    from mamba_rl.agents.gae import _compute_gae_host, _compute_gae_torch, compute_gae

    g = torch.Generator().manual_seed(7)
    n, t_len = 8, 128
    for dtype in (torch.float32, torch.float64):
        rewards = torch.randn(n, t_len, generator=g, dtype=dtype) * 3
        values = torch.randn(n, t_len, generator=g)
        term = torch.rand(n, t_len, generator=g) < 0.05
        trunc = (torch.rand(n, t_len, generator=g) < 0.03) & ~term
        done = term | trunc
        valid = torch.ones(n, t_len, dtype=torch.bool)
        valid[:, 1:] = ~done[:, :-1]  # NextStep: the step after a done is the reset step
        nv = torch.randn(n, generator=g)
        ref = _compute_gae_torch(rewards, values, term, trunc, valid, nv, gamma, lam)
        for got in (_compute_gae_host(rewards, values, term, trunc, valid, nv, gamma, lam),
                    compute_gae(rewards, values, term, trunc, valid, nv, gamma, lam)):
            for a, b in zip(got, ref):
                assert a.dtype == torch.float32 and a.shape == (n, t_len) and a.is_contiguous()
                assert torch.equal(a, b)


@pytest.mark.parametrize("kw", [dict(), dict(clip_vloss=False, norm_adv=False, target_kl=0.002, update_epochs=4),
                                dict(env_id="mamba_rl/CartPoleNoVel-v1", prev_action=True, prev_reward=True),
                                dict(aux_gamma=0.9, aux_gae_lambda=0.65, aux_adv_weight=0.3),
                                dict(aux_gamma=0.8, aux_gae_lambda=1.0, clip_vloss=False, norm_adv=True)])
def test_cpu_update_is_the_autograd_and_torch_adam_update_bit_for_bit(tmp_path, kw):
    """The whole eager CPU update (hand-written head gradients, the flat host Adam, the squared head norm, the
    lean metrics rows) against the autograd + torch.optim.Adam update on the same rollout: equal bits."""
    from mamba_rl.agents import RecurrentPPO
    from mamba_rl.agents.update import PPOUpdate

    cfg = dict(env_id="CartPole-v1", num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, d_model=16,
               n_layers=2, d_state=4, device="cpu", track=False, checkpoint_every=0, total_timesteps=10_000,
               checkpoint_dir=str(tmp_path))
    cfg.update(kw)
    new, old = RecurrentPPO(**cfg), RecurrentPPO(**cfg)
    assert new.updater._hand_grads
    old.head_optimizer = torch.optim.Adam(old.policy.heads.parameters(), lr=old.config.learning_rate, eps=1e-5)
    old.updater = PPOUpdate(old.config, old.policy, old.trainer, old.head_optimizer, old.buffer)
    old.updater._hand_grads = False  # the autograd path
    for _ in range(2):
        new.collect_rollout()
        old.collect_rollout()
        assert torch.equal(new.buffer.advantages, old.buffer.advantages)
        if new.config.aux_gamma is not None:
            assert torch.equal(new.buffer.aux_advantages, old.buffer.aux_advantages)
        mn, mo = new.update_policy(), old.update_policy()
        assert mn == mo
    assert torch.equal(new.policy.net.arena, old.policy.net.arena)
    for p, q in zip(new.policy.heads.parameters(), old.policy.heads.parameters()):
        assert torch.equal(p, q)
    for sn, so in zip(new.head_optimizer.state_dict()["state"].values(), old.head_optimizer.state_dict()["state"].values()):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(sn[k]), torch.as_tensor(so[k]))
    new.close()
    old.close()


@pytest.mark.parametrize("space", [spaces.Discrete(3), spaces.MultiDiscrete([2, 4, 3]), spaces.Box(-1, 1, (2,))])
def test_log_prob_numpy_is_log_prob(space):
    g = torch.Generator().manual_seed(3)
    head = ActorHead(8, space, g)
    with torch.no_grad():
        dist = head(torch.randn(64, 8, generator=g) * 30)
        a = dist.sample(g)
        got = dist.log_prob_numpy(a.numpy())
        assert got.dtype == np.float32 and got.shape == (64,)
        assert np.array_equal(got, dist.log_prob(a).numpy())


def test_compute_gae_on_cpu_tensors_that_require_grad_stays_differentiable():
    """The host (numpy) loop cannot take tensors that require grad: compute_gae keeps the torch loop for them,
    so a caller computing GAE from critic outputs with grad mode on gets differentiable results, as before."""
    from mamba_rl.agents.gae import _compute_gae_torch, compute_gae

    g = torch.Generator().manual_seed(0)
    n, t_len = 3, 6
    rewards = torch.randn(n, t_len, generator=g)
    values = torch.randn(n, t_len, generator=g).requires_grad_()
    term = torch.zeros(n, t_len, dtype=torch.bool)
    term[0, 2] = True
    valid = torch.ones(n, t_len, dtype=torch.bool)
    valid[0, 3] = False
    nv = torch.randn(n, generator=g).requires_grad_()
    trunc = torch.zeros_like(term)
    adv, ret = compute_gae(rewards, values, term, trunc, valid, nv, 0.99, 0.95)
    ref = _compute_gae_torch(rewards, values, term, trunc, valid, nv, 0.99, 0.95)
    assert adv.grad_fn is not None and torch.equal(adv, ref[0]) and torch.equal(ret, ref[1])
    adv.sum().backward()
    assert values.grad is not None and nv.grad is not None
    with torch.no_grad():  # no graph to record: the host loop, same bits
        for a, b in zip(compute_gae(rewards, values, term, trunc, valid, nv, 0.99, 0.95), ref):
            assert torch.equal(a, b)


def test_compute_gae_on_the_host_overflows_like_the_torch_loop_without_numpy_warnings():
    """Rewards near float32's max overflow the returns to inf (and 0 * inf to NaN) in both loops; the host loop
    must not emit numpy's RuntimeWarnings for it (the torch loop is silent; under -W error they are exceptions)."""
    import warnings

    from mamba_rl.agents.gae import _compute_gae_torch, compute_gae

    n, t_len = 2, 6
    rewards = torch.full((n, t_len), 3e38)
    values = torch.zeros(n, t_len)
    term = torch.zeros(n, t_len, dtype=torch.bool)
    term[0, 3] = True
    valid = torch.ones(n, t_len, dtype=torch.bool)
    valid[0, 4] = False
    nv = torch.full((n,), float("inf"))
    ref = _compute_gae_torch(rewards, values, term, term.clone().zero_(), valid, nv, 0.99, 0.95)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compute_gae(rewards, values, term, term.clone().zero_(), valid, nv, 0.99, 0.95)
    assert not torch.isfinite(ref[0]).all()
    for a, b in zip(got, ref):
        assert torch.equal(a.nan_to_num(0.0, 1.0, -1.0), b.nan_to_num(0.0, 1.0, -1.0))
        assert torch.equal(a.isnan(), b.isnan())


def test_cpu_update_with_a_frozen_head_parameter_is_the_autograd_update(tmp_path):
    """A head parameter with requires_grad False: the hand-written path must not step it behind autograd's back
    (it computed and applied every head gradient); the update takes the autograd path, whose error says why."""
    from mamba_rl.agents import RecurrentPPO

    a = RecurrentPPO(env_id="CartPole-v1", num_envs=4, num_steps=16, num_minibatches=2, update_epochs=1, d_model=16,
                     n_layers=1, d_state=4, device="cpu", track=False, checkpoint_every=0,
                     checkpoint_dir=str(tmp_path))
    assert a.updater._hand_grads
    bias = a.policy.critic.linear.bias
    bias.requires_grad_(False)
    before = bias.detach().clone()
    a.collect_rollout()
    with pytest.raises(RuntimeError, match="does not require grad"):
        a.update_policy()
    assert torch.equal(bias, before)
    a.close()


@pytest.mark.parametrize("space", [spaces.Discrete(3), spaces.MultiDiscrete([2, 4, 3]), spaces.Box(-1, 1, (2,))])
def test_log_prob_numpy_of_a_distribution_with_grad(space):
    """A distribution built with grad mode on (its parameters require grad): log_prob_numpy gives the values of
    log_prob, as numpy arrays always are, detached (numpy() refused a tensor that requires grad)."""
    g = torch.Generator().manual_seed(4)
    head = ActorHead(8, space, g)
    dist = head(torch.randn(16, 8, generator=g))
    with torch.no_grad():
        a = head(torch.randn(16, 8, generator=g)).sample(g)
    got = dist.log_prob_numpy(a.numpy())
    assert np.array_equal(got, dist.log_prob(a).detach().numpy())
