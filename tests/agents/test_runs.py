"""Two runs never share a run folder, even when started in the same second."""

import itertools

import torch
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents import runs

TINY = dict(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=16, n_layers=1, d_state=4,
            device="cpu", total_timesteps=32, checkpoint_every=0)


def _cfg(tmp_path, **kw):
    return PPOConfig(**TINY, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"), **kw)


def _two_runs_at_the_same_instant(tmp_path, monkeypatch):
    monkeypatch.setattr(runs.time, "time", lambda: 1_700_000_000.0)  # frozen clock
    a = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, seed=3))
    b = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, seed=3))
    with torch.no_grad():  # different weights, so that a load shows whose checkpoint it read
        b.policy.net.arena.add_(0.25)
    return a, b


def test_same_second_runs_get_their_own_folders(tmp_path, monkeypatch):
    a, b = _two_runs_at_the_same_instant(tmp_path, monkeypatch)
    a.learn()
    b.learn()
    a.close(), b.close()
    assert a.run_name != b.run_name
    assert a.run_name.startswith("CartPole-v1__mamba_ppo__3__1700000000__")
    for root in ("runs", "ckpt"):
        assert (tmp_path / root / a.run_name).is_dir() and (tmp_path / root / b.run_name).is_dir()
    for agent in (a, b):
        loaded = RecurrentPPO.load(tmp_path / "ckpt" / agent.run_name / "final")
        torch.testing.assert_close(loaded.policy.net.arena, agent.policy.net.arena, rtol=0, atol=0)
        assert loaded.run_name == agent.run_name
        loaded.close()


def test_a_clashing_name_is_never_reused(tmp_path, monkeypatch):
    """Even when the random suffixes collide, the second run creates a fresh folder instead of sharing."""
    suffixes = itertools.chain(["aaaaaa", "aaaaaa"], itertools.repeat("bbbbbb"))
    monkeypatch.setattr(runs.secrets, "token_hex", lambda n: next(suffixes))
    a, b = _two_runs_at_the_same_instant(tmp_path, monkeypatch)
    assert a.run_name == b.run_name  # the same name drawn twice...
    a.learn()
    (tmp_path / "ckpt" / a.run_name / "final" / "marker").write_text("run a")
    b.learn()  # ...yet b's claim finds a's folders and takes a new name
    a.close(), b.close()
    assert b.run_name.endswith("__bbbbbb") and a.run_name.endswith("__aaaaaa")
    assert (tmp_path / "ckpt" / a.run_name / "final" / "marker").read_text() == "run a"
    loaded = RecurrentPPO.load(tmp_path / "ckpt" / a.run_name / "final")
    torch.testing.assert_close(loaded.policy.net.arena, a.policy.net.arena, rtol=0, atol=0)
    loaded.close()


def test_resume_writes_into_its_own_run(tmp_path):
    a = RecurrentPPO("CartPole-v1", config=_cfg(tmp_path, seed=1))
    a.learn()
    a.close()
    resumed = RecurrentPPO.load(tmp_path / "ckpt" / a.run_name / "final", total_timesteps=64)
    resumed.learn()
    resumed.close()
    assert resumed.run_name == a.run_name
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [a.run_name]
