"""The GPU agent loop's parts, CPU-checkable where the logic allows; `cuda` tests need a GPU.

- parallel GAE == the loop GAE; the one input staging (HostStager) writes the documented layout;
- the sampler draws from the right distribution (chi-square), eagerly on the CPU and graph-captured on CUDA;
- FlatHeadAdam == torch.optim.Adam, and a skipped step changes nothing;
- f16 overflow skips skip the heads too: finite metrics and weights, the scale recovers;
- CUDA: the graph rollout keeps the eager semantics; the captured update equals the eager update.
"""

import math

import numpy as np
import pytest
import torch
from gymnasium import spaces
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.gae import compute_gae, compute_gae_parallel
from mamba_rl.agents.head_optim import FlatHeadAdam
from mamba_rl.agents.heads import ActionDist, ActorHead
from mamba_rl.agents.policy import HostStager
from mamba_rl.agents.tags import AUX_METRICS

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# chi-square critical values at p = 0.001 (df -> value): a correct sampler fails one seed in a thousand
CHI2_999 = {3: 16.27, 5: 20.52, 9: 27.88, 11: 31.26}


def _rollout_flags(n, t, seed):
    g = torch.Generator().manual_seed(seed)
    term = torch.rand(n, t, generator=g) < 0.08
    trunc = (torch.rand(n, t, generator=g) < 0.05) & ~term
    done = term | trunc
    valid = torch.ones(n, t, dtype=torch.bool)
    valid[:, 1:] = ~done[:, :-1]  # NextStep: the step after a done is the reset step
    valid[:, 0] = torch.rand(n, generator=g) > 0.2
    return term, trunc, valid, g


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.0), (1.0, 1.0)])
def test_parallel_gae_matches_the_loop(gamma, lam):
    term, trunc, valid, g = _rollout_flags(6, 41, seed=3)
    rewards, values, nv = torch.randn(6, 41, generator=g), torch.randn(6, 41, generator=g), torch.randn(6, generator=g)
    a0, r0 = compute_gae(rewards, values, term, trunc, valid, nv, gamma, lam)
    a1, r1 = compute_gae_parallel(rewards, values, term, trunc, valid, nv, gamma, lam)
    torch.testing.assert_close(a1, a0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r1, r0, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="valid must be bool"):
        compute_gae_parallel(rewards, values, term, trunc, valid.float(), nv, gamma, lam)


@pytest.mark.parametrize("space", [spaces.Discrete(3, start=2), spaces.MultiDiscrete([2, 3]),
                                   spaces.Box(-1.0, 2.0, (2,), np.float32)])
def test_host_staging_writes_the_input_layout(space):
    """[obs | previous action (one-hot per discrete part, clipped for Box) | previous reward | start], the
    action and reward zeroed at starts; env actions shifted by ``start`` / clipped."""
    from mamba_rl import MambaConfig
    from mamba_rl.agents.policy import Policy

    pol = Policy(MambaConfig(d_model=16, n_layers=1, d_state=4), 3, space, torch.device("cpu"), 0,
                 backend="reference", prev_action=True, prev_reward=True)
    n = 5
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(n, 3)).astype(np.float32)
    if isinstance(space, spaces.Box):
        act = rng.normal(scale=3, size=(n, 2)).astype(np.float32)
        enc = np.clip(act, -1.0, 2.0)
        env_act = np.clip(act, -1.0, 2.0)
    else:
        nvec = [space.n] if isinstance(space, spaces.Discrete) else list(space.nvec)
        act = np.stack([rng.integers(0, k, n) for k in nvec], 1).astype(np.int64)
        enc = np.concatenate([np.eye(k, dtype=np.float32)[act[:, i]] for i, k in enumerate(nvec)], axis=1)
        env_act = act[:, 0] + 2 if isinstance(space, spaces.Discrete) else act
    rew, start = rng.normal(size=n).astype(np.float32), np.array([True, False, False, True, False])
    keep = (~start).astype(np.float32)[:, None]
    want = np.concatenate([obs, enc * keep, rew[:, None] * keep, start[:, None].astype(np.float32)], axis=1)
    stage = np.full((n, pol.input_dim + 1), np.nan, np.float32)
    st = HostStager(pol, stage)
    st.build(obs, act, rew, start)
    np.testing.assert_array_equal(stage, want)
    np.testing.assert_array_equal(st.to_env(act), env_act)
    with pytest.raises(ValueError, match=rf"stage must be float32 \[N, {pol.input_dim + 1}\]"):
        HostStager(pol, np.zeros((n, 2), np.float32))


def test_host_staging_writes_the_time_encoding_before_the_start_flag():
    """[obs | previous action | previous reward | time_features(episode_step) | start]; a time-encoding policy's
    stage refuses a build without the in-episode step."""
    from mamba_rl import MambaConfig
    from mamba_rl.agents.policy import Policy, time_features

    pol = Policy(MambaConfig(d_model=16, n_layers=1, d_state=4), 3, spaces.Discrete(2), torch.device("cpu"), 0,
                 backend="reference", prev_action=True, prev_reward=True, time_encoding=3)
    assert pol.input_dim == 3 + 2 + 1 + 6
    n = 4
    obs = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    act, rew = np.array([[0], [1], [1], [0]]), np.ones(n, np.float32)
    start, steps = np.array([True, False, False, False]), np.array([0, 1, 7, 1000])
    stage = np.full((n, pol.input_dim + 1), np.nan, np.float32)
    st = HostStager(pol, stage)
    st.build(obs, act, rew, start, steps)
    np.testing.assert_array_equal(stage[:, 6:12], time_features(steps, 3))
    np.testing.assert_array_equal(stage[:, -1], start.astype(np.float32))
    np.testing.assert_array_equal(stage[:, 5], [0, 1, 1, 1])
    with pytest.raises(ValueError, match=r"time_encoding=3\); pass episode_step \(\[4\] ints\)"):
        st.build(obs, act, rew, start)


def test_time_features_are_the_sinusoids_of_doubling_periods():
    from mamba_rl.agents.policy import time_features

    t = np.array([0, 1, 3, 5, 64, 123_457])
    got = time_features(t, 4)
    assert got.dtype == np.float32 and got.shape == (6, 8)
    for j, period in enumerate((4, 8, 16, 32)):
        np.testing.assert_allclose(got[:, j], np.sin(2 * np.pi * t / period), atol=1e-6)
        np.testing.assert_allclose(got[:, 4 + j], np.cos(2 * np.pi * t / period), atol=1e-6)
    np.testing.assert_array_equal(got[0], [0, 0, 0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        time_features(t, 0)
    with pytest.raises(ValueError, match="non-negative integers, got dtype float64"):
        time_features(t.astype(np.float64), 2)
    with pytest.raises(ValueError, match="non-negative integers"):
        time_features(np.array([3, -1]), 2)


def _chi2(counts, probs):
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def _categorical_draws(dist_fn, draws):
    """Counts of every joint action of a 2-categorical MultiDiscrete over ``draws`` rows."""
    acts = dist_fn().cpu()
    return torch.bincount(acts[:, 0] * 3 + acts[:, 1], minlength=6).double()


def _check_categorical(sample, logits_a, logits_b, draws):
    counts = sample()
    p = (torch.softmax(logits_a, -1)[:, None] * torch.softmax(logits_b, -1)[None, :]).reshape(-1).double()
    assert _chi2(counts, p) < CHI2_999[5], (counts, p * draws)


def _gaussian_bins(x, mean, std):
    edges = mean + std * torch.special.ndtri(torch.linspace(0, 1, 11, dtype=torch.float64)[1:-1])
    return torch.bincount(torch.bucketize(x.double(), edges), minlength=10).double()


def _dists(device):
    la = torch.tensor([0.3, -1.0], device=device)
    lb = torch.tensor([1.2, 0.0, -0.7], device=device)
    head = ActorHead(4, spaces.MultiDiscrete([2, 3]))
    return la, lb, head.splits


def test_eager_sampler_chi_square_discrete_and_gaussian():
    draws = 60_000
    la, lb, splits = _dists("cpu")
    g = torch.Generator().manual_seed(11)
    raw = torch.cat([la, lb]).expand(draws, 5)
    dist = ActionDist("multicategorical", (raw,), splits)
    _check_categorical(lambda: _categorical_draws(lambda: dist.sample(g), draws), la, lb, draws)
    single = ActionDist("categorical", (lb.expand(draws, 3),))
    counts = torch.bincount(single.sample(g)[:, 0], minlength=3).double()
    assert _chi2(counts, torch.softmax(lb, -1).double()) < CHI2_999[3]
    mean, log_std = torch.tensor([0.5, -2.0]), torch.tensor([0.0, 0.7])
    gauss = ActionDist("gaussian", (mean.expand(draws, 2), log_std.expand(draws, 2)))
    x = gauss.sample(g)
    for k in range(2):
        assert _chi2(_gaussian_bins(x[:, k], mean[k].double(), log_std[k].exp().double()),
                     torch.full((10,), 0.1, dtype=torch.float64)) < CHI2_999[9]


@cuda
@pytest.mark.cuda
def test_captured_sampler_draws_from_the_eager_distribution():
    rows, reps = 2_000, 30
    la, lb, splits = _dists("cuda")
    raw = torch.cat([la, lb]).expand(rows, 5).contiguous()
    mean = torch.tensor([0.5, -2.0], device="cuda").expand(rows, 2).contiguous()
    log_std = torch.tensor([0.0, 0.7], device="cuda").expand(rows, 2).contiguous()
    cat = ActionDist("multicategorical", (raw,), splits)
    gauss = ActionDist("gaussian", (mean, log_std))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cat.sample(), gauss.sample()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a_out, x_out = cat.sample(), gauss.sample()
    acts, xs = [], []
    for _ in range(reps):
        g.replay()
        acts.append(a_out.clone())
        xs.append(x_out.clone())
    assert not torch.equal(acts[0], acts[1])  # the philox offset advances per replay
    acts, xs = torch.cat(acts).cpu(), torch.cat(xs).cpu()
    _check_categorical(lambda: torch.bincount(acts[:, 0] * 3 + acts[:, 1], minlength=6).double(), la.cpu(),
                       lb.cpu(), rows * reps)
    for k, (m, s) in enumerate([(0.5, 1.0), (-2.0, math.exp(0.7))]):
        counts = _gaussian_bins(xs[:, k], torch.tensor(m, dtype=torch.float64), torch.tensor(s, dtype=torch.float64))
        assert _chi2(counts, torch.full((10,), 0.1, dtype=torch.float64)) < CHI2_999[9]


def test_flat_head_adam_is_torch_adam_and_skips_exactly():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(3))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    flat = FlatHeadAdam(ps, lr=1e-2, eps=1e-5)
    ref = torch.optim.Adam(qs, lr=1e-2, eps=1e-5)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in ps]
        for p, q, gr in zip(ps, qs, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        flat.step()
        ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    before = [t.clone() for t in (flat.param_arena, flat.exp_avg, flat.exp_avg_sq, flat.step_t)]
    nan = torch.full_like(flat.param_arena, float("nan"))
    flat.flat_step(nan, torch.tensor(1e-2), torch.tensor(float("nan")), torch.tensor(True))
    for a, b in zip(before, (flat.param_arena, flat.exp_avg, flat.exp_avg_sq, flat.step_t)):
        assert torch.equal(a, b)
    # a torch.optim.Adam state dict loads into the arena (checkpoint format unchanged)
    fresh = FlatHeadAdam([torch.nn.Parameter(q.detach().clone()) for q in qs], lr=1e-2, eps=1e-5)
    fresh.load_state_dict(ref.state_dict())
    assert float(fresh.step_t) == 5.0
    torch.testing.assert_close(fresh.exp_avg_sq, torch.cat([ref.state[q]["exp_avg_sq"].reshape(-1) for q in qs]))


def test_f16_skipped_steps_skip_the_heads_too(tmp_path):
    agent = RecurrentPPO("mamba_rl/CartPoleNoVel-v1", dtype="f16", device="cpu", d_model=16, n_layers=2, d_state=4,
                         num_envs=4, num_steps=32, total_timesteps=256, track=False, checkpoint_every=0,
                         checkpoint_dir=str(tmp_path))
    agent.learn()
    first, last = agent.history[0], agent.history[-1]
    assert first["backbone/overflow_skipped"] >= 1  # the scale starts at 2^16 and overflows at first
    for m in agent.history:
        for k, v in m.items():
            if k != "losses/explained_variance":
                assert math.isfinite(v), (k, v)
    # before the fix: 16/16 skipped in both updates, scale 1.5e-05, NaN heads; now it settles
    assert last["backbone/overflow_skipped"] == 0
    assert last["backbone/loss_scale"] >= 2.0 ** 10
    for name, p in agent.policy.heads.named_parameters():
        assert torch.isfinite(p).all(), name
    assert torch.isfinite(agent.policy.net.arena).all()
    agent.close()


# ------------------------------------------------------------------------------- CUDA: graph rollout/update
def _gpu_agent(tmp_path, graphs=True, **kw):
    cfg = dict(num_envs=8, num_steps=24, num_minibatches=2, update_epochs=2, total_timesteps=10_000, d_model=16,
               n_layers=2, d_state=16, device="cuda", cuda_graphs=graphs, track=False, checkpoint_every=0,
               runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), seed=3)
    cfg.update(kw)
    return RecurrentPPO(config=PPOConfig(**cfg))


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("terminate", [False, True])
def test_graph_rollout_keeps_the_rollout_semantics(tmp_path, terminate, toy_envs):
    from mamba_rl.agents.device_actor import GraphActor

    agent = RecurrentPPO(toy_envs(terminate=terminate), config=PPOConfig(
        env_id="toy", num_envs=4, num_steps=24, num_minibatches=2, update_epochs=2, total_timesteps=10_000,
        d_model=16, n_layers=2, d_state=16, device="cuda", track=False, checkpoint_every=0, seed=3,
        runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt")))
    assert isinstance(agent.actor, GraphActor)
    agent.collect_rollout()
    agent.collect_rollout()  # a carried state and resets mid-rollout
    b = agent.buffer
    for i in range(4):
        length, period = 3 + i, 4 + i
        first = int(torch.nonzero(b.episode_starts[i].cpu())[0])
        for t in range(first, 24):
            phase = (t - first) % period
            assert bool(b.episode_starts[i, t]) == (phase == 0), (i, t)
            assert bool(b.valid[i, t]) == (phase != length), (i, t)
    # GAE on the device == the loop GAE wherever a done before the last column cuts the recursion (there
    # the bootstrap value, which this test does not know, does not enter)
    rew, val, term, trunc, valid = (getattr(b, k).cpu() for k in ("rewards", "values", "terminations",
                                                                   "truncations", "valid"))
    adv, _ = compute_gae(rew, val, term, trunc, valid, torch.zeros(4), 0.99, 0.95)
    done = (term | trunc)[:, :-1]
    cut = torch.zeros_like(valid)
    cut[:, :-1] = done.flip(1).cumsum(1).flip(1) > 0
    assert cut.sum() > 40
    torch.testing.assert_close(b.advantages.cpu()[cut], adv[cut], rtol=1e-5, atol=1e-5)
    # the update recomputes the rollout's values and log-probs from the stored state and starts
    assert agent.update_policy()["debug/rollout_parity"] < 1e-4
    agent.close()


@cuda
@pytest.mark.cuda
def test_graph_rollout_writes_the_time_encoding_of_each_envs_clock(tmp_path, toy_envs):
    """On the graph-captured rollout the stored inputs end with time_features of the toy env's own step counter
    (obs[0] * 10), across two rollouts, and the update's recomputation agrees with the rollout."""
    from mamba_rl.agents.device_actor import GraphActor
    from mamba_rl.agents.policy import time_features

    agent = RecurrentPPO(toy_envs(terminate=True), config=PPOConfig(
        env_id="toy", num_envs=4, num_steps=24, num_minibatches=2, update_epochs=2, total_timesteps=10_000,
        d_model=16, n_layers=2, d_state=16, device="cuda", track=False, checkpoint_every=0, seed=3,
        time_encoding=3, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt")))
    assert isinstance(agent.actor, GraphActor)
    for _ in range(2):
        agent.collect_rollout()
        b = agent.buffer
        env_t = torch.round(b.obs[..., 0].cpu() * 10).to(torch.int64)
        want = time_features(env_t.reshape(-1).numpy(), 3).reshape(4, 24, 6)
        np.testing.assert_array_equal(b.inputs[..., -6:].cpu().numpy(), want)
    assert agent.update_policy()["debug/rollout_parity"] < 1e-4
    agent.close()


def _copy_rollout(src, dst):
    for k in ("inputs", "actions", "logprobs", "values", "rewards", "terminations", "truncations", "episode_starts",
              "valid", "advantages", "returns", "aux_values", "aux_advantages", "aux_returns"):
        if getattr(src.buffer, k) is not None:  # the aux columns: with the two-horizon critic (the default)
            getattr(dst.buffer, k).copy_(getattr(src.buffer, k).to(getattr(dst.buffer, k).device))
    dst.buffer.initial_state.copy_(src.buffer.initial_state.to(dst.policy.device))


def assert_same_update(a, b, ma, mb):
    """Two agents' updates agree: every metric (debug/* aside) and the backbone and head weights after it."""
    for k in ma:
        if not k.startswith("debug/"):
            assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-5), (k, ma[k], mb[k])
    torch.testing.assert_close(a.policy.net.arena, b.policy.net.arena, rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(a.policy.heads.named_parameters(), b.policy.heads.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_update_with_the_flat_head_adam_equals_torch_adam_on_cpu(tmp_path):
    from mamba_rl.agents.update import PPOUpdate

    kw = dict(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, d_model=16, n_layers=2, d_state=4,
              device="cpu", track=False, checkpoint_every=0, total_timesteps=10_000, checkpoint_dir=str(tmp_path))
    ref, flat = RecurrentPPO("CartPole-v1", **kw), RecurrentPPO("CartPole-v1", **kw)
    flat.head_optimizer = FlatHeadAdam(flat.policy.heads.parameters(), lr=flat.config.learning_rate, eps=1e-5)
    flat.updater = PPOUpdate(flat.config, flat.policy, flat.trainer, flat.head_optimizer, flat.buffer)
    ref.collect_rollout()
    _copy_rollout(ref, flat)
    mr, mf = ref.update_policy(), flat.update_policy()
    for k in mr:
        assert mf[k] == pytest.approx(mr[k], rel=1e-4, abs=1e-6), k
    torch.testing.assert_close(flat.policy.net.arena, ref.policy.net.arena, rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(flat.policy.heads.named_parameters(), ref.policy.heads.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_captured_update_equals_eager_update(tmp_path, dtype):
    g_agent = _gpu_agent(tmp_path / "g", graphs=True, env_id="CartPole-v1", dtype=dtype)
    e_agent = _gpu_agent(tmp_path / "e", graphs=False, env_id="CartPole-v1", dtype=dtype)
    assert g_agent.policy.aux_critic is not None  # the default two-horizon critic: its columns and loss too
    torch.testing.assert_close(g_agent.policy.net.arena, e_agent.policy.net.arena, rtol=0, atol=0)
    g_agent.collect_rollout()
    _copy_rollout(g_agent, e_agent)
    mg, me = g_agent.update_policy(), e_agent.update_policy()
    assert set(AUX_METRICS) <= set(mg) and set(AUX_METRICS) <= set(me)
    assert_same_update(g_agent, e_agent, mg, me)
    g_agent.close()
    e_agent.close()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_graph_agent_trains_discrete_and_box(tmp_path, env_id):
    agent = _gpu_agent(tmp_path, env_id=env_id, total_timesteps=3 * 8 * 24, prev_action=True, prev_reward=True,
                       target_kl=0.5)
    agent.learn()
    for m in agent.history:
        assert all(math.isfinite(v) for k, v in m.items() if k != "losses/explained_variance"), m
    assert agent.history[-1]["debug/rollout_parity"] < 1e-4
    if env_id == "Pendulum-v1":
        assert agent.buffer.actions.abs().max() > 0  # stored raw; clipped only for the env
    agent.close()
