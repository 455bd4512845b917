"""mamba_rl.envs: POMDP ids, make_vec_env's stack, flattening, and the NextStep autoreset it relies on."""

import re

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from mamba_rl.envs import (
    POMDP_ENV_IDS,
    MaskObservation,
    find_vector_wrapper,
    make_env,
    make_vec_env,
)


@pytest.mark.parametrize("env_id", sorted(POMDP_ENV_IDS))
def test_pomdp_ids_mask_velocities_of_the_same_dynamics(env_id):
    base_id, keep, max_steps, _ = POMDP_ENV_IDS[env_id]
    masked, base = gym.make(env_id), gym.make(base_id)
    assert masked.spec.max_episode_steps == max_steps == base.spec.max_episode_steps
    assert masked.observation_space.shape == (len(keep),)
    o_m, _ = masked.reset(seed=3)
    o_b, _ = base.reset(seed=3)
    np.testing.assert_array_equal(o_m, o_b[list(keep)])
    masked.action_space.seed(0)
    for _ in range(20):
        a = masked.action_space.sample()
        o_m, r_m, t_m, tr_m, _ = masked.step(a)
        o_b, r_b, t_b, tr_b, _ = base.step(a)
        np.testing.assert_array_equal(o_m, o_b[list(keep)])
        assert (r_m, t_m, tr_m) == (r_b, t_b, tr_b)
        if t_m or tr_m:
            break


def test_cartpole_novel_hides_both_velocities():
    env = gym.make("mamba_rl/CartPoleNoVel-v1")
    obs, _ = env.reset(seed=0)
    full = env.unwrapped.state  # [x, x_dot, theta, theta_dot]
    np.testing.assert_allclose(obs, np.asarray(full, dtype=np.float32)[[0, 2]])


def test_mask_observation_rejects_bad_input():
    with pytest.raises(TypeError, match="1-D Box"):
        MaskObservation(gym.make("FrozenLake-v1"), [0])
    with pytest.raises(ValueError, match=r"distinct indices in \[0, 4\)"):
        MaskObservation(gym.make("CartPole-v1"), [0, 4])


def test_make_vec_env_stack_and_next_step_autoreset():
    envs = make_vec_env("CartPole-v1", num_envs=3, seed=0, normalize_obs=True)
    assert isinstance(envs.unwrapped, gym.vector.SyncVectorEnv)
    assert envs.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP
    assert find_vector_wrapper(envs, gym.wrappers.vector.RecordEpisodeStatistics) is not None
    assert find_vector_wrapper(envs, gym.wrappers.vector.NormalizeObservation) is not None
    envs.reset(seed=0)
    done_prev = np.zeros(3, bool)
    saw_reset_step = False
    for _ in range(200):
        obs, rew, term, trunc, info = envs.step(np.zeros(3, dtype=np.int64))  # always left: short episodes
        # the step after a done is the reset step: reward 0, no done (what the agent masks out)
        if done_prev.any():
            saw_reset_step = True
            assert np.all(rew[done_prev] == 0) and not np.any((term | trunc)[done_prev])
        if (term | trunc).any():
            assert np.all(info["_episode"] == (term | trunc))
        done_prev = term | trunc
    assert saw_reset_step
    envs.close()


def test_unknown_id_and_bad_num_envs():
    with pytest.raises(gym.error.NameNotFound, match="unknown env id 'NoSuchEnv-v0'"):
        make_vec_env("NoSuchEnv-v0", 2)
    for bad in (0, 2.7, "3", True, None):  # no silent int(): 2.7 would build 2 envs, True 1
        with pytest.raises(ValueError, match=rf"num_envs must be an int >= 1, got {re.escape(repr(bad))}"):
            make_vec_env("CartPole-v1", bad)


def test_mask_observation_refuses_indices_that_are_not_ints():
    for bad in ([0.7, 2.2], "01", [0, True]):
        with pytest.raises(ValueError, match="keep must be a sequence of int indices"):
            MaskObservation(gym.make("CartPole-v1"), bad)
    env = MaskObservation(gym.make("CartPole-v1"), [2, np.int64(0)])
    assert env.observation_space.shape == (2,)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2,)


class _SpacesEnv(gym.Env):
    """One-step env with a composite observation space (no user wrapper needed)."""

    def __init__(self, observation_space):
        self.observation_space = observation_space
        self.action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 1.0, True, False, {}


@pytest.mark.parametrize("space,width", [
    (spaces.Discrete(4), 4),
    (spaces.MultiDiscrete([2, 3]), 5),
    (spaces.Tuple((spaces.Discrete(2), spaces.Box(-1, 1, (3,)))), 5),
    (spaces.Dict({"a": spaces.MultiDiscrete([3, 3]), "b": spaces.Box(0, 1, (2, 2))}), 10),
])
def test_flatten_one_hot_for_discrete_parts(space, width):
    gym.register("mamba_rl_test/Spaces-v0", entry_point=_SpacesEnv, kwargs={"observation_space": space})
    try:
        env = make_env("mamba_rl_test/Spaces-v0")
        assert env.observation_space.shape == (width,) and env.observation_space.dtype == np.float32
        obs, _ = env.reset(seed=0)
        assert obs.dtype == np.float32 and obs.shape == (width,)
        raw_obs, _ = _SpacesEnv(space).reset(seed=0)  # same seed -> same sample
        np.testing.assert_array_equal(obs, spaces.flatten(space, raw_obs).astype(np.float32))
        if isinstance(space, spaces.Discrete):
            assert obs.sum() == 1.0 and set(np.unique(obs)) == {0.0, 1.0}  # one-hot
    finally:
        del gym.registry["mamba_rl_test/Spaces-v0"]


def test_popgym_ids_go_through_untouched():
    pytest.importorskip("popgym")
    envs = make_vec_env("popgym-AutoencodeEasy-v0", num_envs=2, seed=0)
    # Tuple(Discrete(2), Discrete(4)) -> one-hot width 6
    assert envs.single_observation_space.shape == (6,)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 6) and set(np.unique(obs)) <= {0.0, 1.0}
    envs.close()


class _TupleObsEnv(gym.Env):
    """A Tuple(Discrete, Box) observation: one continuous part."""

    observation_space = spaces.Tuple((spaces.Discrete(3), spaces.Box(-5.0, 5.0, (2,), np.float32)))
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 1.0, False, False, {}


@pytest.mark.parametrize("space, continuous", [
    (spaces.Discrete(4), False), (spaces.MultiDiscrete([3, 3]), False), (spaces.MultiBinary(5), False),
    (spaces.Tuple((spaces.Discrete(2), spaces.Discrete(4))), False),
    (spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Tuple((spaces.MultiBinary(2),))}), False),
    (spaces.Box(-1.0, 1.0, (2,)), True), (spaces.Box(0, 255, (2,), np.uint8), True),
    (spaces.Tuple((spaces.Discrete(2), spaces.Box(-1.0, 1.0, (1,)))), True),
    (spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Dict({"c": spaces.Box(0.0, 1.0, (1,))})}), True),
])
def test_has_continuous_part(space, continuous):
    from mamba_rl.envs.vector import has_continuous_part

    assert has_continuous_part(space) is continuous


@pytest.mark.parametrize("async_", [False, True])
def test_normalize_obs_skips_all_discrete_observations(async_):
    """One-hot codes of discrete observations are not normalised (make_vec_env's doc); a space with a Box part is,
    whole, after flattening; the async path reads the raw space from one env built in this process."""
    norm = gym.wrappers.vector.NormalizeObservation
    discrete = make_vec_env("FrozenLake-v1", 2, seed=0, normalize_obs=True, async_=async_)
    try:
        assert find_vector_wrapper(discrete, norm) is None
        discrete.reset(seed=0)
        obs, *_ = discrete.step(np.ones(2, dtype=np.int64))
        assert set(np.unique(obs)) <= {0.0, 1.0}  # still one-hot
    finally:
        discrete.close()
    if "mamba_rl_test/TupleObs-v0" not in gym.registry:
        gym.register("mamba_rl_test/TupleObs-v0", entry_point=_TupleObsEnv)
    for env_id in ("CartPole-v1", "mamba_rl_test/TupleObs-v0"):
        envs = make_vec_env(env_id, 2, seed=0, normalize_obs=True, async_=async_)
        try:
            assert find_vector_wrapper(envs, norm) is not None, env_id
            envs.reset(seed=0)
            envs.step(np.zeros(2, dtype=np.int64))
        finally:
            envs.close()
    # obs_norm_discrete: the one-hot codes are normalised too (and nothing without normalize_obs)
    both = make_vec_env("FrozenLake-v1", 2, seed=0, normalize_obs=True, obs_norm_discrete=True, async_=async_)
    off = make_vec_env("FrozenLake-v1", 2, seed=0, normalize_obs=False, obs_norm_discrete=True, async_=async_)
    try:
        assert find_vector_wrapper(both, norm) is not None and find_vector_wrapper(off, norm) is None
        both.reset(seed=0)
        obs, *_ = both.step(np.ones(2, dtype=np.int64))
        assert not set(np.unique(obs)) <= {0.0, 1.0}  # no longer one-hot
    finally:
        both.close()
        off.close()


class _NeedsPrevActionEnv(gym.Env):
    """An env that declares, as POPGym's bandit does, that its observation needs the previous action."""

    obs_requires_prev_action = True
    observation_space = spaces.Discrete(2)
    action_space = spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        return int(action == 1), 0.0, False, False, {}


@pytest.mark.parametrize("async_", [False, True])
def test_requires_prev_action_reads_the_base_envs_declaration(async_):
    from mamba_rl.envs import requires_prev_action

    gym.register("mamba_rl_test/NeedsPrev-v0", entry_point=_NeedsPrevActionEnv, max_episode_steps=5)
    try:
        envs = make_vec_env("mamba_rl_test/NeedsPrev-v0", num_envs=2, seed=0, async_=async_)
        try:  # through TimeLimit, the flattening and the vector wrappers to the base env
            assert requires_prev_action(envs, "mamba_rl_test/NeedsPrev-v0") is True
            # an async env's sub-envs live in its workers: without the id there is nothing to ask
            assert requires_prev_action(envs) is (not async_)
        finally:
            envs.close()
    finally:
        del gym.registry["mamba_rl_test/NeedsPrev-v0"]
    envs = make_vec_env("mamba_rl/CartPoleNoVel-v1", num_envs=2, seed=0, async_=async_)
    try:  # no declaration: False
        assert requires_prev_action(envs, "mamba_rl/CartPoleNoVel-v1") is False
    finally:
        envs.close()


def test_popgym_declares_which_tasks_need_the_previous_action():
    pytest.importorskip("popgym")
    from mamba_rl.envs import requires_prev_action

    got = {}
    for task in ("MultiarmedBanditEasy", "ConcentrationEasy", "BattleshipEasy", "AutoencodeEasy",
                 "RepeatPreviousEasy"):
        envs = make_vec_env(f"popgym-{task}-v0", num_envs=1, seed=0)
        got[task] = requires_prev_action(envs)
        envs.close()
    assert got == {"MultiarmedBanditEasy": True, "ConcentrationEasy": True, "BattleshipEasy": True,
                   "AutoencodeEasy": False, "RepeatPreviousEasy": False}
