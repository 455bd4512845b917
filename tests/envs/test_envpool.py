"""The EnvPool backend (envs/envpool_backend.py) against the gymnasium path: the same transitions, resets,
truncations, episode statistics and normalised rewards for the same actions from the same states.

EnvPool draws its initial states from its own RNG, so the gymnasium path's CartPole sub-envs are made to start
every episode (the first and every NextStep autoreset) from the state EnvPool's reset step returned; from
there both run the same dynamics. The tests that need EnvPool skip without it (an optional extra); the
backend-selection tests and the adapter over a fake in-process pool (FakePool: gymnasium's envs behind
EnvPool's sync-mode API, rows shuffled per step) run everywhere.
"""


import gymnasium as gym
import numpy as np
import pytest

from mamba_rl.envs import (EnvPoolVecEnv, VecNormalizeObservation, VecNormalizeReward, env_part_rows, envpool_available,
                           envpool_task, find_vector_wrapper, make_vec_env, resolve_env_backend)

needs_envpool = pytest.mark.skipif(not envpool_available(),
                                   reason="envpool is not installed (optional extra: pip install -e \".[envpool]\")")


def _scripted_resets(envs: gym.vector.VectorEnv, pending: dict[int, np.ndarray]) -> None:
    """Make sub-env i of a gymnasium SyncVectorEnv of CartPole start each episode at ``pending[i]``."""
    for i, sub in enumerate(envs.unwrapped.envs):
        cp = sub.unwrapped

        def reset(cp=cp, i=i, *, seed=None, options=None):
            type(cp).reset(cp, seed=seed, options=options)
            cp.state = np.asarray(pending[i], dtype=np.float64)
            return np.array(cp.state, dtype=np.float32), {}

        cp.reset = reset


def _policy(obs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Even envs balance the pole (long episodes, truncations), odd envs act at random (terminations)."""
    a = (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)
    a[1::2] = rng.integers(0, 2, a[1::2].shape)
    return a


@needs_envpool
@pytest.mark.parametrize("normalize_obs", [False, True])
def test_same_transitions_as_the_gymnasium_path(normalize_obs):
    n, limit, seed = 6, 40, 11
    kw = dict(seed=seed, normalize_reward=True, normalize_obs=normalize_obs, gamma=0.97,
              env_kwargs={"max_episode_steps": limit})
    pool = make_vec_env("CartPole-v1", n, backend="envpool", **kw)
    ref = make_vec_env("CartPole-v1", n, backend="gymnasium", **kw)
    assert isinstance(pool.unwrapped, EnvPoolVecEnv) and isinstance(ref.unwrapped, gym.vector.SyncVectorEnv)
    pending: dict[int, np.ndarray] = {}
    _scripted_resets(ref, pending)
    raw_pool = find_vector_wrapper(pool, EnvPoolVecEnv)

    # the raw (unnormalised) obs of EnvPool's sub-envs: the states the gymnasium envs are reset to
    raw_obs = {}
    orig_step, orig_reset = raw_pool.step, raw_pool.reset

    def step(actions):
        out = orig_step(actions)
        raw_obs["last"] = out[0]
        return out

    def reset(**k):
        out = orig_reset(**k)
        raw_obs["last"] = out[0]
        return out

    raw_pool.step, raw_pool.reset = step, reset
    o_p, _ = pool.reset(seed=seed)
    pending.update(enumerate(raw_obs["last"]))
    o_r, _ = ref.reset(seed=seed)
    np.testing.assert_array_equal(o_p, o_r)
    rng = np.random.default_rng(0)
    done_prev = np.zeros(n, bool)
    counts = {"term": 0, "trunc": 0, "episodes": 0}
    for t in range(400):
        a = _policy(raw_obs["last"], rng)
        o_p, r_p, te_p, tr_p, i_p = pool.step(a)
        pending.update((i, raw_obs["last"][i]) for i in np.nonzero(done_prev)[0])  # this step reset them
        o_r, r_r, te_r, tr_r, i_r = ref.step(a)
        np.testing.assert_allclose(o_p, o_r, rtol=1e-5, atol=1e-5, err_msg=f"step {t}")
        np.testing.assert_array_equal(te_p, te_r, err_msg=f"step {t}")
        np.testing.assert_array_equal(tr_p, tr_r, err_msg=f"step {t}")
        assert r_p.dtype == r_r.dtype == np.float64
        np.testing.assert_array_equal(r_p, r_r, err_msg=f"step {t}")  # same rewards and dones: same statistics
        assert ("_episode" in i_p) == ("_episode" in i_r)
        if "_episode" in i_p:
            np.testing.assert_array_equal(i_p["_episode"], i_r["_episode"])
            np.testing.assert_array_equal(i_p["episode"]["r"], i_r["episode"]["r"])
            np.testing.assert_array_equal(i_p["episode"]["l"], i_r["episode"]["l"])
            counts["episodes"] += int(i_p["_episode"].sum())
        if done_prev.any():  # the NextStep reset step: reward 0, no done, the next episode's first obs
            assert np.all(r_p[done_prev] == 0) and not np.any((te_p | tr_p)[done_prev])
        counts["term"] += int(te_p.sum())
        counts["trunc"] += int(tr_p.sum())
        done_prev = te_p | tr_p
    assert counts["term"] > 10 and counts["trunc"] > 10 and counts["episodes"] == counts["term"] + counts["trunc"]
    pool.close()
    ref.close()


@needs_envpool
def test_masked_ids_seeding_and_spaces():
    envs = make_vec_env("mamba_rl/CartPoleNoVel-v1", 3, seed=4, backend="envpool")
    base = make_vec_env("CartPole-v1", 3, seed=4, backend="envpool")
    ref = make_vec_env("mamba_rl/CartPoleNoVel-v1", 3, seed=4)
    assert envs.single_observation_space == ref.single_observation_space
    assert envs.single_action_space == ref.single_action_space
    o, _ = envs.reset(seed=4)
    ob, _ = base.reset(seed=4)
    np.testing.assert_array_equal(o, ob[:, [0, 2]])  # the velocities masked, as MaskObservation does
    one = make_vec_env("CartPole-v1", 1, backend="envpool")
    np.testing.assert_array_equal(one.reset(seed=5)[0][0], ob[1])  # sub-env i is seeded with seed + i
    a = np.array([1, 0, 1])
    first = [envs.step(a)[0] for _ in range(5)]
    o2, _ = envs.reset(seed=4)  # the same seed again: the same episode again
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal([envs.step(a)[0] for _ in range(5)], first)
    assert envpool_task("mamba_rl/CartPoleNoVel-v1") == ("CartPole-v1", (0, 2), 500)
    # a batch in another env order comes back in env order (masked and float32)
    raw = find_vector_wrapper(envs, EnvPoolVecEnv)
    full = np.arange(12, dtype=np.float64).reshape(3, 4)
    obs, rew = raw._rows(0, full[[2, 0, 1]], {"env_id": np.array([2, 0, 1], np.int32)}, np.array([20.0, 0.0, 10.0]))
    np.testing.assert_array_equal(obs, full[:, [0, 2]].astype(np.float32))
    np.testing.assert_array_equal(rew, [0.0, 10.0, 20.0])
    assert obs.dtype == np.float32
    with pytest.raises(ValueError, match=r"expected an int seed \(sub-env i gets seed \+ i\), got 'x'"):
        envs.reset(seed="x")
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle

        pickle.dumps(envs)
    for e in (envs, base, ref, one):
        e.close()


@needs_envpool
def test_agent_rollout_on_envpool_has_the_reset_step_semantics(tmp_path):
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    cfg = PPOConfig(env_id="CartPole-v1", env_backend="envpool", num_envs=4, num_steps=64, num_minibatches=2,
                    update_epochs=1, total_timesteps=512, d_model=16, n_layers=1, d_state=4, device="cpu",
                    track=False, checkpoint_every=0, runs_dir=str(tmp_path / "r"), checkpoint_dir=str(tmp_path / "c"))
    agent = RecurrentPPO(config=cfg)
    assert isinstance(agent.envs.unwrapped, EnvPoolVecEnv)
    episodes, _ = agent.collect_rollout()
    b = agent.buffer
    done = (b.terminations | b.truncations).numpy()
    valid, starts, rewards = b.valid.numpy(), b.episode_starts.numpy(), b.rewards.numpy()
    assert done.any() and episodes
    for i in range(4):
        for t in range(1, 64):
            assert valid[i, t] == (not done[i, t - 1])  # the step after a done is the reset step
            if not valid[i, t]:
                assert rewards[i, t] == 0 and not done[i, t]
            if t >= 2:
                assert starts[i, t] == (not valid[i, t - 1])  # the obs after a reset step starts an episode
    assert all(length >= 8 for _, _, length in episodes)
    agent.update_policy()
    path = agent.save(tmp_path / "ckpt")  # the pool cannot be pickled: the learner is saved, the envs are not
    assert (path / "agent.safetensors").exists() and not (path / "envs.pkl").exists()
    agent.close()


def test_backend_selection_and_errors(monkeypatch):
    assert resolve_env_backend("gymnasium", "CartPole-v1") == "gymnasium"
    with pytest.raises(ValueError, match=r"env backend must be one of \('gymnasium', 'envpool', 'auto'\), got 'pool'"):
        resolve_env_backend("pool", "CartPole-v1")
    with pytest.raises(ValueError, match="expected async_envs=False"):
        resolve_env_backend("envpool", "CartPole-v1", async_=True)
    with pytest.raises(ValueError, match="expected capture_video=False"):
        resolve_env_backend("envpool", "CartPole-v1", capture_video=True)
    assert resolve_env_backend("auto", "CartPole-v1", async_=True) == "gymnasium"
    assert resolve_env_backend("auto", "FrozenLake-v1") == ("gymnasium" if envpool_task("FrozenLake-v1") is None
                                                            else "envpool")
    expect = "envpool" if envpool_available() else "gymnasium"
    assert resolve_env_backend("auto", "CartPole-v1") == expect
    import mamba_rl.envs.envpool_backend as eb

    monkeypatch.setattr(eb, "envpool_available", lambda: False)
    assert eb.envpool_task("CartPole-v1") is None
    with pytest.raises(ImportError, match=r"needs the optional envpool package: pip install -e \"\.\[envpool\]\""):
        EnvPoolVecEnv("CartPole-v1", 2)


@needs_envpool
def test_unknown_envpool_id_is_a_clear_error():
    with pytest.raises(ValueError, match=r"EnvPool has no task for env id 'mamba_rl/NoSuch-v0'"):
        make_vec_env("mamba_rl/NoSuch-v0", 2, backend="envpool")


def test_config_and_cli_take_the_env_backend():
    from mamba_rl.agents import PPOConfig

    assert PPOConfig().env_backend == "gymnasium"
    with pytest.raises(ValueError, match=r"PPOConfig.env_backend must be one of .*'gymnasium'.*got 'pool'"):
        PPOConfig(env_backend="pool")
    with pytest.raises(ValueError, match=r"expected async_envs=False .*got async_envs=True"):
        PPOConfig(env_backend="envpool", async_envs=True)
    with pytest.raises(ValueError, match=r"expected capture_video=False .*got capture_video=True"):
        PPOConfig(env_backend="envpool", capture_video=True)
    assert PPOConfig(env_backend="auto", async_envs=True).env_backend == "auto"  # auto: gymnasium's async workers
    from mamba_rl.agents.cli import build_parser

    args = build_parser().parse_args(["train", "--env-backend", "auto"])
    assert args.env_backend == "auto"




class FakePool:
    """What EnvPoolVecEnv uses of a sync-mode EnvPool pool, built from gymnasium's own envs, so that the adapter
    runs without envpool (CI): sub-env i seeded with seed + i at the first reset, NextStep autoreset (the step
    after a done resets and returns reward 0, no done), float32 rewards, and the rows of every step in another
    order, named by ``info["env_id"]``."""

    def __init__(self, task_id, num_envs, seed, max_episode_steps=None, **kwargs):
        self.envs = [gym.make(task_id, max_episode_steps=max_episode_steps) for _ in range(num_envs)]
        self.observation_space, self.action_space = self.envs[0].observation_space, self.envs[0].action_space
        self.seed, self.n, self.t, self.seeded = seed, num_envs, 0, False
        self.done = np.zeros(num_envs, bool)

    def _order(self):
        self.t += 1
        return np.roll(np.arange(self.n, dtype=np.int32), self.t)

    def reset(self):
        obs = [e.reset(seed=None if self.seeded else self.seed + i)[0] for i, e in enumerate(self.envs)]
        self.seeded, self.done[:] = True, False
        order = self._order()
        return np.stack(obs)[order], {"env_id": order}

    def step(self, actions):
        out = []
        for i, e in enumerate(self.envs):
            out.append((e.reset()[0], 0.0, False, False) if self.done[i] else e.step(actions[i])[:4])
        obs, rew, term, trunc = (np.array(x) for x in zip(*out))
        self.done = term | trunc
        order = self._order()
        return obs[order], rew[order].astype(np.float32), term[order], trunc[order], {"env_id": order}

    def send(self, actions):
        self._sent = actions

    def recv(self):
        return self.step(self._sent)

    def close(self):
        for e in self.envs:
            e.close()


def _fake_pools(monkeypatch):
    """EnvPoolVecEnv over FakePools (one per part, sub-env seeds as EnvPool's: the part's first row + i)."""
    import mamba_rl.envs.envpool_backend as eb

    monkeypatch.setattr(eb, "envpool_available", lambda: True)
    monkeypatch.setattr(eb, "_envpool_ids", lambda: frozenset({"CartPole-v1"}))
    monkeypatch.setattr(eb.EnvPoolVecEnv, "_make_pools", lambda self, seed: tuple(
        FakePool(self.task_id, r.stop - r.start, seed + r.start, **self.pool_kwargs) for r in self.part_rows))


@pytest.mark.parametrize("parts", [1, 2])
def test_the_adapter_over_a_fake_pool_matches_the_gymnasium_path_bit_for_bit(monkeypatch, parts):
    """Runs everywhere: the EnvPool path's adapter and wrappers over FakePool (gymnasium's CartPole, so the
    same seeds give the same episodes) against the gymnasium path, transition by transition; with two parts
    (two pools of 2 and 3 envs) a whole ``step`` is the same as with one."""
    _fake_pools(monkeypatch)
    n, seed = 5, 7
    kw = dict(seed=seed, normalize_reward=True, normalize_obs=True, env_kwargs={"max_episode_steps": 30})
    pool = make_vec_env("CartPole-v1", n, backend="envpool", env_parts=parts, **kw)
    assert env_part_rows(pool) == (None if parts == 1 else (slice(0, 2), slice(2, 5)))
    ref = make_vec_env("CartPole-v1", n, backend="gymnasium", **kw)
    assert isinstance(pool.unwrapped, EnvPoolVecEnv)
    np.testing.assert_array_equal(pool.reset(seed=seed)[0], ref.reset(seed=seed)[0])
    rng = np.random.default_rng(1)
    obs = None
    ends = truncs = 0
    for t in range(300):  # mostly the balancing policy (truncations at 30 steps), every third step at random
        a = rng.integers(0, 2, n) if obs is None or t % 3 == 0 else (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)
        o1, r1, te1, tr1, i1 = pool.step(a)
        o2, r2, te2, tr2, i2 = ref.step(a)
        for x, y in ((o1, o2), (r1, r2), (te1, te2), (tr1, tr2)):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"step {t}"
        assert ("_episode" in i1) == ("_episode" in i2)
        if "_episode" in i1:
            np.testing.assert_array_equal(i1["_episode"], i2["_episode"])
            for k in ("r", "l"):
                np.testing.assert_array_equal(i1["episode"][k], i2["episode"][k])
            ends += int(i1["_episode"].sum())
        truncs += int(tr1.sum())
        obs = o1
    assert ends > 20 and truncs > 0
    np.testing.assert_array_equal(pool.reset(seed=seed)[0], ref.reset(seed=seed)[0])  # reseeding: a new pool
    pool.close()
    ref.close()


def test_stepping_in_parts_equals_whole_steps(monkeypatch):
    """``send_part`` / ``recv_part`` through the whole wrapper stack (guard, statistics, both normalisations):
    the same dones, episode statistics and, without normalisation, observations and rewards as whole steps, bit
    for bit; with normalisation the running statistics after each step equal the whole step's up to rounding,
    and so do the second half's observations and rewards (the first half is normalised before the second
    half's rows are in: mamba_rl.envs.parts)."""
    _fake_pools(monkeypatch)
    n, seed = 6, 3
    for norm in (False, True):
        kw = dict(seed=seed, normalize_reward=norm, normalize_obs=norm, env_kwargs={"max_episode_steps": 20})
        parted = make_vec_env("CartPole-v1", n, backend="envpool", env_parts=2, **kw)
        whole = make_vec_env("CartPole-v1", n, backend="envpool", **kw)
        rows = env_part_rows(parted)
        assert rows == (slice(0, 3), slice(3, 6)) and env_part_rows(whole) is None
        np.testing.assert_array_equal(parted.reset(seed=seed)[0], whole.reset(seed=seed)[0])
        rng = np.random.default_rng(0)
        ends = 0
        for t in range(200):
            a = rng.integers(0, 2, n)
            for h, r in enumerate(rows):
                parted.send_part(h, a[r])
            got = [parted.recv_part(h) for h in range(len(rows))]
            ow, rw, tew, trw, iw = whole.step(a)
            o, r_, te, tr = (np.concatenate([g[i] for g in got]) for i in range(4))
            np.testing.assert_array_equal(te, tew)
            np.testing.assert_array_equal(tr, trw)
            if norm:
                np.testing.assert_allclose(o[rows[1]], ow[rows[1]], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(r_[rows[1]], rw[rows[1]], rtol=1e-5, atol=1e-6)
                for cls, w in ((VecNormalizeObservation, "obs_rms"), (VecNormalizeReward, "return_rms")):
                    a_, b_ = (getattr(find_vector_wrapper(e, cls), w) for e in (parted, whole))
                    np.testing.assert_allclose(a_.mean, b_.mean, rtol=1e-6, atol=1e-9)
                    np.testing.assert_allclose(a_.var, b_.var, rtol=1e-6, atol=1e-9)
                    assert a_.count == b_.count
            else:
                assert o.tobytes() == ow.tobytes() and r_.tobytes() == rw.tobytes()
            none = [np.zeros(r.stop - r.start, bool) for r in rows]
            done_p = np.concatenate([g[4].get("_episode", z) for g, z in zip(got, none)])
            np.testing.assert_array_equal(done_p, iw.get("_episode", np.zeros(n, bool)))
            if done_p.any():
                for k in ("r", "l"):
                    vals = np.concatenate([g[4]["episode"][k] if "episode" in g[4] else z for g, z in zip(got, none)])
                    np.testing.assert_array_equal(vals, iw["episode"][k])
                ends += int(done_p.sum())
        with pytest.raises(ValueError, match=r"expected a part sent with send_part, got part 0"):
            parted.recv_part(0)
        parted.send_part(0, a[rows[0]])
        with pytest.raises(ValueError, match=r"not sent yet, got part 0"):
            parted.send_part(0, a[rows[0]])
        parted.reset(seed=seed)  # drains the step sent and never received
        assert ends > 20
        parted.close()
        whole.close()


@needs_envpool
def test_two_real_pools_step_as_one():
    """EnvPool seeds sub-env i of a pool with seed + i: two pools of the halves give one pool's transitions."""
    one = make_vec_env("CartPole-v1", 6, seed=2, backend="envpool")
    two = make_vec_env("CartPole-v1", 6, seed=2, backend="envpool", env_parts=2)
    np.testing.assert_array_equal(one.reset(seed=2)[0], two.reset(seed=2)[0])
    rng = np.random.default_rng(0)
    for _ in range(100):
        a = rng.integers(0, 2, 6)
        for x, y in zip(one.step(a)[:4], two.step(a)[:4]):
            assert x.tobytes() == y.tobytes()
    one.close()
    two.close()
