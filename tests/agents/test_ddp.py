"""Data-parallel PPO: 2 ranks x 4 envs = 1 process x 8 envs; bit-identical ranks; resume.

Ranks are spawned with ``torch.multiprocessing`` (gloo on the CPU, NCCL on 2 GPUs for the ``cuda`` test).
"""

from __future__ import annotations

import os
import shutil
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.distributed import shard_permutation

from .ddp_cases import (TINY, captured_hang_worker, cli_bug_worker, fake_rollout, flat_state, hang_worker, learn_worker,
                        mismatch_worker, normalize_obs_worker, split_graph_worker, update_worker)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args, world: int = 2) -> None:
    mp.spawn(fn, args=(world, _port()) + args, nprocs=world, join=True)


def test_shard_permutation_matches_the_ranks_minibatches():
    rows = shard_permutation(np.random.default_rng(3), 8, 2, shards=2)
    local = shard_permutation(np.random.default_rng(3), 4, 2)  # what each of 2 ranks draws
    for k in range(2):
        assert sorted(rows[k].tolist()) == sorted(local[k].tolist() + (local[k] + 4).tolist())
    with pytest.raises(ValueError, match="shards"):
        shard_permutation(np.random.default_rng(0), 6, 2, shards=2)  # 3 envs per shard, 2 minibatches


def _one_process(tmp_path, device: str, updates: int, extra: dict | None = None):
    cfg = PPOConfig(**dict(TINY, num_envs=8), device=device, runs_dir=str(tmp_path / "runs"),
                    checkpoint_dir=str(tmp_path / "ckpt"), **(extra or {}))
    agent = RecurrentPPO(config=cfg)
    init, metrics = flat_state(agent), []
    # minibatch k = the envs of both ranks' minibatch k
    rows = lambda: shard_permutation(agent.rngs.minibatch, 8, cfg.num_minibatches, shards=2)  # noqa: E731
    for u in range(updates):
        fake_rollout(agent, 8, 0, seed=100 + u)
        metrics.append(agent.updater.run(agent.config, rows))
    final = flat_state(agent)
    agent.close()
    return init, final, metrics


def _check_update_identity(tmp_path, device: str, rtol: float = 1e-4, atol: float = 2e-5,
                           extra: dict | None = None, moves: bool = True) -> None:
    updates = 2
    _spawn(update_worker, str(tmp_path), device, updates, extra)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["same"] == [True] * updates and r1["same"] == [True] * updates  # bit-identical after every update
    assert torch.equal(r0["final"], r1["final"])
    init, final, metrics = _one_process(tmp_path, device, updates, extra)
    assert torch.equal(r0["init"], init)  # same weights from the config seed
    assert ((final - init).abs().max() > 1e-4) == moves  # the updates did move the weights (or, stopped, did not)
    torch.testing.assert_close(r0["final"], final, rtol=rtol, atol=atol)
    for m_dp, m_one in zip(r0["metrics"], metrics):
        keys = ["losses/value_loss", "losses/policy_loss", "losses/entropy", "losses/approx_kl",
                "losses/clipfrac", "backbone/grad_norm"]
        if extra and extra.get("aux_gamma") is not None:  # the aux loss: each rank's share of the global mean
            keys.append("losses/aux_value_loss")
        if extra and extra.get("action_set_coef"):  # its mean over the known steps of every rank's minibatch
            keys.append("losses/action_set_loss")
        if extra and extra.get("max_minibatch_kl") is not None:
            keys.append("losses/kl_stopped_steps")
            # stopped at the first minibatch: every planned step of the update left untaken
            assert m_dp["losses/kl_stopped_steps"] == TINY["num_minibatches"] * TINY["update_epochs"]
        for k in keys:
            assert m_dp[k] == pytest.approx(m_one[k], rel=10 * rtol, abs=1e-6), k


def test_two_ranks_equal_one_process_gloo(tmp_path):
    _check_update_identity(tmp_path, "cpu")


def test_two_ranks_equal_one_process_with_a_kl_stop_gloo(tmp_path):
    """max_minibatch_kl: the stop is decided on the minibatch's whole approx_kl (each rank's share summed in the
    gradients' all-reduce), so every rank skips the same steps, as one process with all the envs does. The fake
    rollouts' stored log-probs are not the policy's, so the first minibatch already exceeds the limit: nothing
    moves, on both ranks and in the one process."""
    _check_update_identity(tmp_path, "cpu", extra=dict(max_minibatch_kl=1e-9), moves=False)


def test_two_ranks_equal_one_process_with_the_aux_critic_gloo(tmp_path):
    """The two-horizon critic: the aux head's gradient is in the all-reduced heads' gradient, and the advantages
    are mixed with the stds of both ranks' rollouts (one all-reduce), as one process with all the envs mixes."""
    _check_update_identity(tmp_path, "cpu", extra=dict(aux_gamma=0.9, aux_gae_lambda=0.65, aux_adv_weight=0.3))


def test_two_ranks_equal_one_process_with_the_action_set_loss_gloo(tmp_path):
    """The action-set loss: its head's gradient is in the all-reduced heads' gradient and its mean is over the known
    steps of both ranks' minibatches (their count joins the advantage sums' all-reduce), as one process computes."""
    _check_update_identity(tmp_path, "cpu", extra=dict(action_set_coef=3.0))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_equal_one_process_with_the_aux_critic_nccl(tmp_path):
    _check_update_identity(tmp_path, "cuda", rtol=1e-3, atol=1e-4,
                           extra=dict(aux_gamma=0.9, aux_gae_lambda=0.65, aux_adv_weight=0.3))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_equal_one_process_nccl(tmp_path):
    # the CUDA kernels reduce a minibatch of 2 rows per rank in another order than one of 4: looser f32 tolerance
    _check_update_identity(tmp_path, "cuda", rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_resume_two_rank_checkpoint_nccl(tmp_path):
    _check_resume(tmp_path, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_graph_minibatches_equal_eager_ones_gloo_one_gpu(tmp_path):
    # two ranks on one GPU: the captured three-phase minibatch (all-reduces eager between the replays)
    # against eager minibatches, bit for bit, and the ranks identical
    _spawn(split_graph_worker, str(tmp_path))
    res = [torch.load(tmp_path / f"split{r}.pt") for r in range(2)]
    for r in res:
        assert r[True]["captured"] and r[True]["capture_error"] is None, r[True]["capture_error"]
        assert not r[False]["captured"]
        assert torch.equal(r[True]["final"], r[False]["final"])
        assert r[True]["metrics"] == r[False]["metrics"]
    assert torch.equal(res[0][True]["final"], res[1][True]["final"])
    assert not torch.equal(res[0][True]["final"], torch.zeros_like(res[0][True]["final"]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_hanging_rank_is_an_error_on_the_captured_path(tmp_path):
    _spawn(captured_hang_worker, str(tmp_path), 60.0)
    r = torch.load(tmp_path / "chang.pt")
    assert r["captured"], r
    assert r["err"] is not None and r["dt"] < 40.0, r  # the 10 s group timeout, not the 60 s hang


def _check_resume(tmp_path, device: str) -> None:
    per_update = 2 * TINY["num_envs"] * TINY["num_steps"]  # 2 ranks
    _spawn(learn_worker, str(tmp_path / "a"), device, None, 2 * per_update)
    first = torch.load(tmp_path / "a" / "learn0.pt")
    assert first["same"] and first["update"] == 2 and first["global_step"] == 2 * per_update
    ckpt = str(tmp_path / "saved")  # a copy: a resumed run writes its own `final` into the run's folder
    shutil.copytree(f"{first['root']}/final", ckpt)
    # 1 rank: weights, optimizer state and counters load; one more update of 64 steps reaches the total
    agent = RecurrentPPO.load(ckpt, total_timesteps=2 * per_update + 64, device=device,
                              checkpoint_dir=str(tmp_path / "one"), runs_dir=str(tmp_path / "one"))
    assert agent.update == 2 and agent.global_step == 2 * per_update and agent.world_size == 1
    assert torch.equal(flat_state(agent), first["final"])
    agent.learn()
    assert agent.update == 3 and agent.global_step == 2 * per_update + 64
    agent.close()
    # 2 ranks again: both start from the checkpoint and stay identical
    _spawn(learn_worker, str(tmp_path / "b"), device, ckpt, 3 * per_update)
    second = torch.load(tmp_path / "b" / "learn1.pt")
    assert torch.equal(second["start"], first["final"])
    assert second["same"] and second["update"] == 3 and second["global_step"] == 3 * per_update


def test_resume_two_rank_checkpoint_on_one_and_two_ranks_gloo(tmp_path):
    _check_resume(tmp_path, "cpu")


def test_bad_world_setup_is_a_clear_error(monkeypatch):
    from mamba_rl.agents.distributed import DataParallel, init_from_env

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_from_env("cpu")
    with pytest.raises(RuntimeError, match="not initialised"):
        DataParallel()


def test_bad_init_arguments_are_clear_errors_with_or_without_a_job(monkeypatch):
    """A bad backend / timeout_s is refused on one process too (it was silently ignored when WORLD_SIZE <= 1,
    and a bad timeout_s reached c10d as a raw socket error or 'cannot convert float NaN to integer'); a
    WORLD_SIZE that is not an integer names the variable."""
    from mamba_rl.agents.distributed import init_from_env

    for world in (None, "2"):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
            monkeypatch.setenv("MASTER_PORT", "1")
        for bad in ("mpi", "NCCL", "", 1):
            with pytest.raises(ValueError, match=rf"backend must be None, 'gloo' or .*got {bad!r}"):
                init_from_env("cpu", backend=bad)
        for bad in (-1, 0, float("nan"), float("inf"), True, "600"):
            with pytest.raises(ValueError, match=rf"timeout_s must be a finite number of seconds > 0, got {bad!r}"):
                init_from_env("cpu", timeout_s=bad, backend="gloo")
    with pytest.raises(ValueError, match="'nccl' on CUDA"):
        init_from_env("cpu", backend="nccl")  # WORLD_SIZE 2 on the CPU
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RuntimeError, match="WORLD_SIZE must be an integer number of ranks .*got 'two'"):
        init_from_env("cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_from_env("cpu", backend="gloo") is False


def test_a_hanging_rank_is_an_error_within_the_timeout(tmp_path):
    _spawn(hang_worker, str(tmp_path), 10.0)
    r = torch.load(tmp_path / "hang.pt")
    assert r["err"] is not None and r["dt"] < 9.0, r  # the 3 s group timeout, not the 10 s hang


def test_ranks_with_different_configs_refuse_to_start(tmp_path):
    _spawn(mismatch_worker, str(tmp_path))
    for r in range(2):
        err = torch.load(tmp_path / f"mismatch{r}.pt")["err"]
        assert err is not None and "disagree on the PPOConfig" in err and "num_envs" in err, err


def test_ranks_share_their_observation_statistics_gloo(tmp_path):
    """--normalize-obs under data parallel: after every update the ranks hold the same running statistics,
    those of every observation of every rank (gymnasium's RunningMeanStd fed all ranks' batches)."""
    from gymnasium.wrappers.utils import RunningMeanStd

    _spawn(normalize_obs_worker, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"norm{r}.pt", weights_only=False) for r in range(2))
    assert np.array_equal(r0["mean"], r1["mean"]) and np.array_equal(r0["var"], r1["var"])  # was 0.146 vs 0.108
    assert r0["count"] == r1["count"] and r0["ret"] == r1["ret"]
    want = RunningMeanStd(shape=r0["mean"].shape, dtype=r0["mean"].dtype)  # float32, as NormalizeObservation
    for b in r0["batches"] + r1["batches"]:
        want.update(b)
    assert len(r0["batches"]) == 1 + 2 * TINY["num_steps"]  # the reset and every step of 2 rollouts
    assert r0["count"] == pytest.approx(want.count)
    # to float32 rounding (gymnasium accumulates in float32; the merge adds in another order)
    np.testing.assert_allclose(r0["mean"], want.mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r0["var"], want.var, rtol=1e-5, atol=1e-7)


def test_a_bug_mid_training_keeps_its_traceback_under_torchrun(tmp_path):
    """A ValueError raised while training (here by the env, at its 12th step: the second rollout) is not a
    usage error: under torchrun every rank's ``mamba-rl train`` raises it (as the EnvStepError it causes, with
    its traceback: the process exits 1 through Python's handler, torchrun reports the rank's traceback), never
    the one-line error of exit 2."""
    _spawn(cli_bug_worker, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"bug{r}.pt")
        assert res["returned"] is None, res  # main did not turn it into an exit code (2 would be the usage error)
        assert res["raised"] == "EnvStepError", res
        tb = res["traceback"]
        assert "Traceback (most recent call last)" in tb and "ValueError: deliberate bug at env step 12" in tb
        assert "in learn" in tb and "in collect_rollout" in tb and "in step" in tb  # the frames down to the bug
        assert "mamba-rl train: error" not in res["stderr"], res["stderr"]


def test_a_bug_mid_training_under_mamba_rl_train_nproc_exits_non_2_with_the_traceback(tmp_path):
    """The same bug end to end: ``mamba-rl train --nproc 2`` (torchrun, 2 gloo ranks) prints the rank's
    traceback and exits 1 (a rank failed), not 2 with a one-line usage error."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env_id = "tests.agents.ddp_cases:mamba_rl_test/BuggyCartPole-v1"  # the module registers it on import
    argv = [sys.executable, "-m", "mamba_rl", "train", "--nproc", "2", "--env-id", env_id, "--num-envs", "2",
            "--num-steps", "8", "--num-minibatches", "1", "--update-epochs", "1", "--d-model", "8", "--n-layers",
            "1", "--d-state", "2", "--device", "cpu", "--total-timesteps", "128", "--seed", "3", "--no-track",
            "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt"), "--runs-dir", str(tmp_path / "runs")]
    r = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert r.returncode not in (0, 2), (r.returncode, r.stderr[-3000:])
    assert "Traceback (most recent call last)" in r.stderr, r.stderr[-3000:]
    assert "ValueError: deliberate bug at env step 12" in r.stderr, r.stderr[-3000:]
    assert "mamba-rl train: error: deliberate bug" not in r.stderr
    assert "mamba-rl train: error: a rank failed" in r.stderr


def test_mamba_rl_train_nproc_prints_the_run_line_and_the_summary_of_a_single_process_run(tmp_path):
    """``mamba-rl train --nproc 2`` (torchrun, 2 gloo ranks): rank 0's run line names the total env steps with
    thousands separators, dtype and backend as the single-process line does, and the run ends with the mean
    return and the ``done:`` line (a newcomer saw "7 updates of 16384 env steps" and no summary)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "mamba_rl", "train", "--nproc", "2", "--env-id", "CartPole-v1", "--num-envs", "4",
            "--num-steps", "16", "--num-minibatches", "1", "--update-epochs", "1", "--d-model", "8", "--n-layers",
            "1", "--d-state", "2", "--device", "cpu", "--total-timesteps", "2000", "--seed", "3", "--no-track",
            "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt"), "--runs-dir", str(tmp_path / "runs")]
    r = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    # 2000 steps / (2 ranks x 4 envs x 16 steps = 128 per update) -> 16 updates = 2,048 env steps
    assert "2 ranks x 4 envs" in r.stderr and "16 updates of 2x4x16 = 2,048 env steps" in r.stderr, r.stderr[-2000:]
    assert "dtype f32, backend " in r.stderr and "process group gloo" in r.stderr, r.stderr[-2000:]
    assert "mean return of rank 0's last " in r.stderr, r.stderr[-2000:]
    assert "done: 2,048 env steps (2,048 in this session, all ranks) in " in r.stderr, r.stderr[-2000:]
    assert r.stdout.strip().endswith("final"), r.stdout
