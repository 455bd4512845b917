"""Failures replayed from public bug reports: NaN from the env, non-finite updates and
checkpoints, killed saves, TensorBoard after a resume, predict() with raw observations, the lr after a
resume with a larger horizon, checkpoint file modes. CPU, tiny models."""

import math
import os
import shutil
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

from mamba_rl import CheckpointError
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.checkpoint import NonFiniteWeightsError
from mamba_rl.envs import NonFiniteEnvError

TINY = dict(num_envs=2, num_steps=8, num_minibatches=1, update_epochs=1, d_model=16, n_layers=1, d_state=4,
            device="cpu", seed=3, backend="reference")
BATCH = 16


def _cfg(tmp_path, **kw):
    d = dict(TINY, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0)
    d.update(kw)
    return PPOConfig(**d)


class NaNEnv(gym.Env):
    """Box(3) observations; at step ``at`` of every episode (episodes of 6 steps) a NaN obs or reward."""

    def __init__(self, what: str = "reward", at: int = 2):
        self.observation_space = spaces.Box(-1, 1, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.what, self.at, self.t = what, at, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full(3, 0.1, np.float32), {}

    def step(self, action):
        self.t += 1
        obs, reward = np.full(3, 0.2 * int(action), np.float32), 1.0
        if self.t == self.at:
            if self.what == "obs":
                obs[0] = np.nan
            else:
                reward = float("nan")
        return obs, reward, self.t >= 6, False, {}


@pytest.fixture
def nan_env_ids():
    ids = {"obs": "mamba_rl_test/NaNObs-v0", "reward": "mamba_rl_test/NaNReward-v0"}
    for what, env_id in ids.items():
        gym.register(env_id, entry_point=NaNEnv, kwargs={"what": what})
    yield ids
    for env_id in ids.values():
        del gym.registry[env_id]


def _finite(agent) -> bool:
    return bool(torch.isfinite(agent.policy.net.arena).all()) and all(bool(torch.isfinite(p).all())
                                                               for p in agent.policy.heads.parameters())


# ---------------------------------------------------------------------------------------- NaN from the env
@pytest.mark.parametrize("what", ["obs", "reward"])
def test_nan_from_the_env_is_an_error_naming_env_and_step(tmp_path, nan_env_ids, what):
    agent = RecurrentPPO(nan_env_ids[what], config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    kind = "observation" if what == "obs" else "reward"
    with pytest.raises(NonFiniteEnvError, match=rf"env 0 returned a non-finite {kind} at step 2 "):
        agent.learn()
    assert _finite(agent)
    assert not (tmp_path / "ckpt" / agent.run_name / "final").exists()  # nothing saved over anything
    # the state after the last whole update (here: none) is saved apart, for a resume once the env is fixed
    assert agent.failed_checkpoint == tmp_path / "ckpt" / agent.run_name / "env_failed"
    agent.close()
    resumed = RecurrentPPO.load(agent.failed_checkpoint, nonfinite="zero")  # the same env, its NaN zeroed
    assert resumed.update == 0 and resumed.global_step == 0 and _finite(resumed)
    resumed.close()


@pytest.mark.parametrize("what", ["obs", "reward"])
def test_nan_from_the_env_zeroed_and_counted_on_request(tmp_path, nan_env_ids, what):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    agent = RecurrentPPO(nan_env_ids[what], config=_cfg(tmp_path, total_timesteps=2 * BATCH, nonfinite="zero"))
    agent.learn()  # saves `final` (JSON metadata and finite weights)
    agent.close()
    assert _finite(agent)
    acc = EventAccumulator(str(tmp_path / "runs" / agent.run_name))
    acc.Reload()
    tag = "env/nonfinite_obs" if what == "obs" else "env/nonfinite_rewards"
    counts = [e.value for e in acc.Scalars(tag)]
    # one NaN per episode of 6 steps (the reset step after a done is a 7th), 2 envs x 8 steps per update
    assert counts[-1] > counts[0] > 0
    resumed = RecurrentPPO.load(tmp_path / "ckpt" / agent.run_name / "final")
    assert _finite(resumed) and resumed.update == 2
    resumed.close()


def test_a_non_finite_update_is_skipped_and_counted(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.collect_rollout()
    before = [agent.policy.net.arena.clone()] + [p.detach().clone() for p in agent.policy.heads.parameters()]
    agent.buffer.advantages[0, 3] = float("nan")  # e.g. a NaN reward that got past the env
    agent.buffer.returns[1, 2] = float("inf")
    m = agent.update_policy()
    assert m["backbone/overflow_skipped"] == 1.0  # every (here: the one) minibatch step was skipped
    after = [agent.policy.net.arena] + [p.detach() for p in agent.policy.heads.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing applied
    assert agent.trainer.state_dict()["meta"]["step"] == 0
    agent.collect_rollout()
    m = agent.update_policy()  # a clean rollout trains again
    assert m["backbone/overflow_skipped"] == 0.0 and not torch.equal(before[0], agent.policy.net.arena)
    agent.close()


def test_a_checkpoint_never_holds_non_finite_weights(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.learn()
    final = tmp_path / "ckpt" / agent.run_name / "final"
    good = (final / "agent.safetensors").read_bytes()
    with torch.no_grad():
        agent.policy.net.arena[5] = float("nan")
    with pytest.raises(NonFiniteWeightsError, match=r"refusing to save .*final: the backbone weights hold 1 "
                                                     r"non-finite values"):
        agent.save(final)
    assert (final / "agent.safetensors").read_bytes() == good  # the previous checkpoint is left in place
    assert sorted(os.listdir(final.parent)) == ["final"]
    agent.close()


def test_checkpoint_metadata_is_json_safe_with_a_nan_return(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False,
                                                    normalize_obs=True))
    agent.learn()
    agent.recent_returns.append(float("nan"))  # what a NaN reward made of an episode's return
    agent.save(tmp_path / "x")  # was: "save_checkpoint: extra must be JSON-serialisable"
    back = RecurrentPPO.load(tmp_path / "x")
    assert math.isnan(back.recent_returns[-1]) and list(back.recent_returns)[:-1] == list(agent.recent_returns)[:-1]
    back.close()
    agent.close()


# ---------------------------------------------------------------------------------- checkpoint folders
_KILL_SCRIPT = """
import os, signal, sys
from mamba_rl.agents import PPOConfig, RecurrentPPO
import mamba_rl.agents.checkpoint as ck

cfg = PPOConfig(**{cfg!r})
agent = RecurrentPPO("CartPole-v1", config=cfg)
agent.learn()                                 # `final` at update 1
real = ck.save_checkpoint

def save_checkpoint(*a, **k):                 # the next save is killed right after its agent.safetensors
    out = real(*a, **k)
    os.kill(os.getpid(), signal.SIGKILL)

ck.save_checkpoint = save_checkpoint
agent.learn(total_timesteps=2 * {batch})     # update 2, then `final` again: killed
"""


def test_a_killed_save_leaves_the_previous_folder_whole(tmp_path):
    cfg = dict(_cfg(tmp_path, total_timesteps=BATCH, track=False).to_dict())
    cfg.pop("backbone")
    cfg.update(d_model=16, n_layers=1, d_state=4)
    r = subprocess.run([sys.executable, "-c", _KILL_SCRIPT.format(cfg=cfg, batch=BATCH)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    (run,) = os.listdir(tmp_path / "ckpt")
    root = tmp_path / "ckpt" / run
    agent = RecurrentPPO.load(root / "final", restore_envs=True)  # the previous save, both files from it
    assert agent.update == 1 and agent.global_step == BATCH
    leftovers = [e for e in os.listdir(root) if e.startswith(".tmp-")]
    assert leftovers  # the killed save's temporary folder ...
    agent.learn(total_timesteps=2 * BATCH)
    assert sorted(os.listdir(root)) == ["final"]  # ... is removed by the next save
    agent.close()
    again = RecurrentPPO.load(root / "final", restore_envs=True)
    assert again.update == 2
    again.close()


def test_a_save_killed_between_its_renames_is_recovered(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.learn()
    root = tmp_path / "ckpt" / agent.run_name
    os.mkdir(root / "final" / "videos")  # something the user put there (eval --video writes here)
    os.rename(root / "final", root / ".old-final-0123456789ab")  # the previous folder moved aside, the new one
    shutil.copytree(root / ".old-final-0123456789ab", root / ".tmp-final-abcdef012345")  # not yet renamed in
    back = RecurrentPPO.load(root / "final")  # the previous folder is put back
    assert back.update == 1
    back.close()
    agent.save(root / "final")
    assert sorted(os.listdir(root)) == ["final"] and (root / "final" / "videos").is_dir()
    agent.close()


def test_a_sibling_checkpoints_leftovers_are_not_taken_for_its_own(tmp_path):
    """A save of ``agent-best`` killed between its renames leaves ``.old-agent-best-<12 hex>`` (its only copy) and
    one killed before them ``.tmp-agent-best-<12 hex>``: ``.old-agent-`` / ``.tmp-agent-`` begin those names too,
    yet loading or saving ``agent`` neither loads nor removes them (a missing ``agent`` is FileNotFoundError),
    and loading ``agent-best`` puts its previous folder back."""
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.learn()
    root = tmp_path / "ckpt" / agent.run_name
    agent.save(root / "agent-best")
    os.rename(root / "agent-best", root / ".old-agent-best-0123456789ab")
    os.mkdir(root / ".tmp-agent-best-abcdef012345")
    with pytest.raises(FileNotFoundError):
        RecurrentPPO.load(root / "agent")
    agent.save(root / "agent")
    RecurrentPPO.load(root / "agent").close()
    assert sorted(os.listdir(root)) == [".old-agent-best-0123456789ab", ".tmp-agent-best-abcdef012345", "agent",
                                        "final"]
    back = RecurrentPPO.load(root / "agent-best")
    assert back.update == 1
    back.close()
    assert not (root / ".old-agent-best-0123456789ab").exists() and (root / "agent-best").is_dir()
    agent.close()


def test_a_folder_mixing_two_saves_is_refused(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=2 * BATCH, track=False,
                                                    checkpoint_every=1))
    agent.learn()
    root = tmp_path / "ckpt" / agent.run_name
    agent.close()
    # envs.pkl of update 1 beside agent.safetensors of update 2 (what a save killed half-way left before)
    (root / "final" / "envs.pkl").write_bytes((root / "update_000001" / "envs.pkl").read_bytes())
    with pytest.raises(CheckpointError, match=r"envs.pkl .* is not the one saved with agent.safetensors "
                                              r"\(update 2, global step 32\).*mixes two saves"):
        RecurrentPPO.load(root / "final", restore_envs=True)
    RecurrentPPO.load(root / "final").close()  # without --resume-envs the envs are rebuilt: fine


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_follow_the_umask(tmp_path, umask):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.learn(total_timesteps=BATCH)
    old = os.umask(umask)
    try:
        path = agent.save(tmp_path / "modes")
    finally:
        os.umask(old)
    agent.close()
    want = 0o666 & ~umask
    modes = {f: oct(os.stat(path / f).st_mode & 0o777) for f in ("agent.safetensors", "envs.pkl")}
    assert modes == {"agent.safetensors": oct(want), "envs.pkl": oct(want)}


# ------------------------------------------------------------------------------ TensorBoard after resume
def test_resuming_an_earlier_checkpoint_purges_the_later_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=4 * BATCH, checkpoint_every=1))
    agent.learn()
    agent.close()
    import time
    time.sleep(1.1)  # event files are named by the second they were opened in
    resumed = RecurrentPPO.load(tmp_path / "ckpt" / agent.run_name / "update_000002")
    resumed.learn()
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "runs" / agent.run_name))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("charts/SPS")]
    assert steps == [16, 32, 48, 64]  # was [16, 32, 48, 64, 48, 64]
    lr = [e.value for e in acc.Scalars("charts/learning_rate")]
    lr0 = resumed.config.learning_rate
    assert lr == pytest.approx([lr0, 0.75 * lr0, 0.5 * lr0, 0.25 * lr0])


# ----------------------------------------------------------------------------- predict with raw spaces
class _DictEnv(gym.Env):
    observation_space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,), np.float32), "mode": spaces.Discrete(3)})
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), 1.0, self.t >= 5, False, {}


class _TupleEnv(_DictEnv):
    observation_space = spaces.Tuple((spaces.Discrete(4), spaces.Box(0, 1, (3,), np.float32)))


@pytest.mark.parametrize("env_cls", [_DictEnv, _TupleEnv])
def test_predict_takes_raw_dict_and_tuple_observations(tmp_path, env_cls):
    env_id = f"mamba_rl_test/{env_cls.__name__}-v0"
    gym.register(env_id, entry_point=env_cls)
    try:
        agent = RecurrentPPO(env_id, config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
        raw = env_cls().observation_space
        raw.seed(0)
        one = raw.sample()
        flat = spaces.flatten(raw, one).astype(np.float32)
        a_raw, s_raw = agent.predict(one, deterministic=True)
        a_flat, s_flat = agent.predict(flat, deterministic=True)
        assert a_raw == a_flat and torch.equal(s_raw.recurrent.ssm, s_flat.recurrent.ssm)
        batch_space = gym.vector.utils.batch_space(raw, 3)
        batch_space.seed(1)
        batch = batch_space.sample()  # what a vector env of 3 returns
        rows = np.stack([spaces.flatten(raw, o) for o in gym.vector.utils.iterate(batch_space, batch)])
        assert np.array_equal(agent.predict(batch, deterministic=True)[0],
                              agent.predict(rows.astype(np.float32), deterministic=True)[0])
        assert agent.predict([one, one], deterministic=True)[0].shape == (2,)
        bad = {"pos": np.zeros(2)} if env_cls is _DictEnv else (1,)
        with pytest.raises(ValueError, match=r"predict: expected one observation of the env's observation space "
                                             + ("Dict" if env_cls is _DictEnv else "Tuple")):
            agent.predict(bad)
        with pytest.raises(ValueError, match=r"predict: expected a float array \[B, \d+\]"):
            agent.predict([np.zeros(2), np.zeros(3)])  # numpy's "inhomogeneous shape"
        agent.close()
    finally:
        del gym.registry[env_id]


# ------------------------------------------------------------------------ lr after a resume with more steps
def test_resume_with_more_timesteps_continues_the_lr(tmp_path):
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=4 * BATCH, track=False))
    agent.learn()
    last = agent.history[-1]["charts/learning_rate"]
    lr0 = agent.config.learning_rate
    assert last == pytest.approx(0.25 * lr0)  # update 4 of 4
    final = tmp_path / "kept"
    shutil.copytree(tmp_path / "ckpt" / agent.run_name / "final", final)  # a resumed run replaces its `final`
    agent.close()
    resumed = RecurrentPPO.load(final)
    resumed.learn(total_timesteps=6 * BATCH)  # two more updates
    lrs = [h["charts/learning_rate"] for h in resumed.history]
    # continues from lr0 / 4 down to 0 at the new end (update 7): no jump to lr0 / 3 (re-planned over 6)
    assert lrs == pytest.approx([last * 2 / 3, last / 3])
    resumed.close()
    replanned = RecurrentPPO.load(final, replan_lr=True)
    replanned.learn(total_timesteps=5 * BATCH)
    assert replanned.history[0]["charts/learning_rate"] == pytest.approx(lr0 * (1 - 4 / 5))
    replanned.close()


# ------------------------------------------------------------- env failures, totals below the steps done, inputs
class WrongShapeEnv(NaNEnv):
    """Returns a (4,) observation for its (3,) space at step 2."""

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        return (np.zeros(4, np.float32) if self.t == 2 else np.nan_to_num(obs)), 1.0, term, trunc, info


def test_an_env_raising_in_its_step_is_an_env_failure_naming_step_and_space(tmp_path):
    from mamba_rl.envs import EnvFailure, EnvStepError

    gym.register("mamba_rl_test/WrongShape-v0", entry_point=WrongShapeEnv)
    try:
        agent = RecurrentPPO("mamba_rl_test/WrongShape-v0", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
        with pytest.raises(EnvStepError, match=r"raised ValueError at step 2: .*observation space Box\(") as info:
            agent.learn()
        assert isinstance(info.value, EnvFailure) and isinstance(info.value.__cause__, ValueError)
        assert (agent.failed_checkpoint / "agent.safetensors").exists()
        agent.close()
    finally:
        del gym.registry["mamba_rl_test/WrongShape-v0"]


def test_the_cli_reports_an_env_failure_in_one_line_and_saves(tmp_path, nan_env_ids, capsys):
    from mamba_rl.agents.cli import main

    rc = main(["train", "--env-id", nan_env_ids["obs"], "--total-timesteps", "32", "--num-envs", "2", "--num-steps",
               "8", "--num-minibatches", "1", "--d-model", "16", "--n-layers", "1", "--device", "cpu", "--no-progress",
               "--runs-dir", str(tmp_path / "runs"), "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "the env failed during update 1: env 0 returned a non-finite observation" in lines[0]
    saved = list((tmp_path / "ckpt").glob("*/env_failed/agent.safetensors"))
    assert len(saved) == 1 and f"--resume {saved[0].parent}" in lines[0]


def test_a_total_below_the_steps_done_is_refused_and_final_kept(tmp_path, capsys):
    from mamba_rl.agents.cli import main

    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=4 * BATCH, track=False))
    agent.learn()
    final = tmp_path / "ckpt" / agent.run_name / "final"
    agent.close()
    resumed = RecurrentPPO.load(final)
    with pytest.raises(ValueError, match=r"total_timesteps 16 is below the 64 env steps"):
        resumed.learn(total_timesteps=BATCH)
    resumed.learn(total_timesteps=4 * BATCH - 1)  # within the last update: a finished run, nothing to train
    assert resumed.update == 4 and resumed.global_step == 4 * BATCH
    resumed.close()
    stamp = (final / "agent.safetensors").read_bytes()
    rc = main(["train", "--resume", str(final), "--total-timesteps", "16", "--no-progress"])
    assert rc == 2 and "--total-timesteps 16 is below the 64 env steps" in capsys.readouterr().err
    assert (final / "agent.safetensors").read_bytes() == stamp  # `final` not replaced


def test_resume_envs_needs_resume_and_an_envs_file(tmp_path, capsys):
    from mamba_rl.agents.cli import main

    assert main(["train", "--resume-envs", "--no-progress"]) == 2
    assert "--resume-envs restores the envs of a checkpoint: it needs --resume PATH" in capsys.readouterr().err
    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.learn()
    folder = tmp_path / "ckpt" / agent.run_name / "final"
    agent.close()
    (folder / "envs.pkl").unlink()
    with pytest.raises(CheckpointError, match=r"no envs.pkl beside .*the file is missing"):
        RecurrentPPO.load(folder, restore_envs=True)
    RecurrentPPO.load(folder).close()  # without restore_envs the envs are rebuilt: fine


def test_resume_envs_with_another_env_count_is_one_line(tmp_path, capsys):
    """envs.pkl holds the saved run's envs: --num-envs other than theirs is refused by name (exit 2), and the
    same resume without --resume-envs rebuilds the envs at the new count."""
    from mamba_rl.agents.cli import main

    agent = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, total_timesteps=BATCH, track=False))
    agent.learn()
    folder = tmp_path / "ckpt" / agent.run_name / "final"
    agent.close()
    with pytest.raises(CheckpointError, match=r"envs.pkl holds 2 envs but num_envs \(--num-envs\) is 4"):
        RecurrentPPO.load(folder, restore_envs=True, num_envs=4, total_timesteps=4 * BATCH)
    rc = main(["train", "--resume", str(folder), "--resume-envs", "--num-envs", "4", "--no-progress",
               "--total-timesteps", str(4 * BATCH)])
    err = capsys.readouterr().err
    assert rc == 2 and "resume with --num-envs 2, or without --resume-envs" in err and "Traceback" not in err
    RecurrentPPO.load(folder, num_envs=4, total_timesteps=4 * BATCH).close()


def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_earlier_saves(tmp_path, capsys, monkeypatch):
    """A write that fails while training (here safetensors' own error, as on a full disk) ends the CLI run in one
    error line, exit 1; the checkpoint saved before it is intact."""
    from safetensors import SafetensorError

    import mamba_rl.train.checkpoint as ck
    from mamba_rl.agents.cli import main

    real, calls = ck.save_file, []

    def save_file(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(*a, **k)

    monkeypatch.setattr(ck, "save_file", save_file)
    rc = main(["train", "--env", "CartPole-v1", "--total-timesteps", str(3 * BATCH), "--num-envs", "2",
               "--num-steps", "8", "--num-minibatches", "1", "--update-epochs", "1", "--d-model", "16",
               "--n-layers", "1", "--d-state", "4", "--device", "cpu", "--no-progress", "--no-track",
               "--checkpoint-every", "1", "--runs-dir", str(tmp_path / "runs"),
               "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert rc == 1 and "mamba-rl train: error: a write failed after update" in err, err
    assert "No space left on device" in err and "Traceback" not in err
    (run,) = (tmp_path / "ckpt").iterdir()
    saved = [p for p in run.iterdir() if (p / "agent.safetensors").exists()]
    assert len(saved) == 1
    RecurrentPPO.load(saved[0]).close()  # the save before the failure loads
    assert not [p for p in run.rglob(".tmp-*")]  # no temporary left behind


def test_predict_and_value_refuse_bad_inputs_by_name(tmp_path):
    agent = RecurrentPPO("mamba_rl/CartPoleNoVel-v1", config=_cfg(tmp_path, track=False))  # obs_dim 2
    _, state = agent.predict(np.zeros((2, 2), np.float32))
    cases = [
        (lambda: agent.value(np.zeros((1, 4), np.float32), state, np.zeros(2, bool)), r"value: obs must be \[B, 2\]"),
        (lambda: agent.value(np.zeros((2, 2), np.float32), None, np.zeros(2, bool)), r"value: state must be"),
        (lambda: agent.value(np.zeros((3, 2), np.float32), state, np.zeros(3, bool)), r"obs has 3 rows but state holds 2"),
        (lambda: agent.value(np.zeros((2, 2), np.float32), state, None), r"value: episode_start must be \[2\]"),
        (lambda: agent.predict(np.full((2, 2), np.nan, np.float32), state), r"obs rows \[0, 1\] hold NaN / inf"),
        (lambda: agent.predict(np.zeros((2, 2)), state, episode_start=np.array([0.5, 2.0])), r"must be bools"),
        (lambda: agent.predict(np.zeros((2, 2)), state, deterministic="no"), r"deterministic must be a bool"),
        (lambda: agent.predict(np.array([["a", "b"]])), r"obs must be real numbers"),
        (lambda: agent.predict(np.zeros((0, 2))), r"with B >= 1"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    v = agent.value(np.zeros((2, 2), np.float32), state, np.array([1, 0]), reward=[0.0, 1.0])  # 0 / 1: bools
    assert v.shape == (2,) and v.dtype == np.float32 and np.isfinite(v).all()
    agent.close()


class CrashEnv(NaNEnv):
    """Finite observations and rewards; its process exits (as a killed or crashed worker would) at step 3."""

    def step(self, action):
        self.t += 1
        if self.t == 3:
            os._exit(3)
        return np.full(3, 0.2 * int(action), np.float32), 1.0, self.t >= 6, False, {}


def test_a_dead_async_worker_ends_the_cli_in_one_line_and_closes_quietly(tmp_path):
    """Run as a subprocess: the dead worker's env must close without gymnasium's EOFError tracebacks (also the one
    its __del__ printed at interpreter exit)."""
    script = (
        "import sys, gymnasium as gym\n"
        "from tests.agents.test_robustness import CrashEnv\n"
        "gym.register('mamba_rl_test/Crash-v0', entry_point=CrashEnv)\n"
        "from mamba_rl.agents.cli import main\n"
        f"sys.exit(main(['train', '--env-id', 'mamba_rl_test/Crash-v0', '--async-envs', '--async-start-method', "
        f"'fork', '--total-timesteps', '32', '--num-envs', '2', '--num-steps', '8', '--num-minibatches', '1', "
        f"'--d-model', '16', '--n-layers', '1', '--device', 'cpu', '--no-progress', '--runs-dir', "
        f"{str(tmp_path / 'runs')!r}, '--checkpoint-dir', {str(tmp_path / 'ckpt')!r}]))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    assert "error: the env failed during update 1: async env worker" in r.stderr and "exited with code 3" in r.stderr
    assert list((tmp_path / "ckpt").glob("*/env_failed/agent.safetensors"))
