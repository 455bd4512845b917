"""PPOConfig.max_minibatch_kl: an update's minibatch steps stop at the first minibatch whose approx_kl (measured
before its step) exceeds the limit; the stopped steps change nothing and are counted in losses/kl_stopped_steps."""

import pytest
import torch
from mamba_rl.agents import PPOConfig, RecurrentPPO
from mamba_rl.agents.tags import KL_STOPPED, OVERFLOW_SKIPPED, UPDATE_METRICS
from mamba_rl.ops.optim import STEP

TINY = dict(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=3, d_model=16, n_layers=2, d_state=4,
            seed=7, track=False, total_timesteps=128)


def _agent(tmp_path, env="CartPole-v1", device="cpu", **kw):
    cfg = PPOConfig(**dict(TINY, device=device, runs_dir=str(tmp_path / "runs"),
                           checkpoint_dir=str(tmp_path / "ckpt"), **kw))
    return RecurrentPPO(env, config=cfg)


def _heads_step(agent) -> int:
    return int(agent.head_optimizer.step_t)  # FlatHeadAdam's shared step count (CPU and CUDA)


def _weights(agent) -> torch.Tensor:
    return torch.cat([agent.policy.net.arena.detach().cpu()] +
                     [p.detach().cpu().reshape(-1) for p in agent.policy.heads.parameters()])


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan"), "0.05"])
def test_a_limit_that_is_not_a_positive_number_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="PPOConfig.max_minibatch_kl must be"):
        PPOConfig(max_minibatch_kl=bad)


def test_off_by_default_and_a_limit_never_reached_gives_the_same_bits(tmp_path):
    assert PPOConfig().max_minibatch_kl is None
    assert KL_STOPPED in UPDATE_METRICS
    off = _agent(tmp_path / "off")
    off.learn()
    far = _agent(tmp_path / "far", max_minibatch_kl=1e9)
    far.learn()
    assert torch.equal(_weights(off), _weights(far))
    for a in (off, far):
        assert int(a.trainer.scalars[STEP]) == TINY["num_minibatches"] * TINY["update_epochs"]
        a.close()


def test_a_stop_skips_every_later_step_of_the_update_and_counts_it(tmp_path):
    """A limit below any KL after one step: each update takes its first minibatch step (its approx_kl is ~0:
    the rollout's own policy) and stops at the second; the CPU update ends there."""
    agent = _agent(tmp_path, max_minibatch_kl=1e-9)
    metrics = []
    agent.learn(callback=lambda a, m: metrics.append(m))
    assert len(metrics) == 1
    m = metrics[0]
    planned = TINY["num_minibatches"] * TINY["update_epochs"]
    assert m[KL_STOPPED] == planned - 1 and m[OVERFLOW_SKIPPED] == 0.0  # every step of the update but the first
    assert m["losses/approx_kl"] > 1e-9  # the stopping minibatch's estimate
    assert int(agent.trainer.scalars[STEP]) == 1 and _heads_step(agent) == 1  # one step each, the rest skipped
    assert torch.isfinite(agent.policy.net.arena).all() and torch.isfinite(_weights(agent)).all()
    agent.close()


def test_the_stop_resets_each_update_and_a_changed_limit_takes_effect(tmp_path):
    agent = _agent(tmp_path, max_minibatch_kl=1e-9)
    agent.learn()
    assert int(agent.trainer.scalars[STEP]) == 1
    agent.learn(total_timesteps=256)  # a second update: its first step is taken again
    assert int(agent.trainer.scalars[STEP]) == 2
    agent.config = agent.config.replace(max_minibatch_kl=None)
    agent.learn(total_timesteps=384)
    assert int(agent.trainer.scalars[STEP]) == 2 + TINY["num_minibatches"] * TINY["update_epochs"]
    agent.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_cuda_skips_on_the_device_and_keeps_the_f16_loss_scale(tmp_path, graphs, dtype):
    """On CUDA the stopped steps run and are skipped on the device (no sync) up to the epoch's end, where the
    update ends; the backbone and the heads take the same steps, and the metric counts every planned step not
    taken. (The first minibatch's approx_kl is the rollout parity's: ~0 in f32, above 1e-9 in f16 or eagerly on
    some hosts, so 0 or 1 steps are taken.) f16: the loss scaler may skip steps before the stop (the scale starts
    at 2^16 and may overflow at first); those count as overflow skips and halve the scale, and a KL stop neither
    counts as one nor backs the scale off."""
    agent = _agent(tmp_path, device="cuda", cuda_graphs=graphs, dtype=dtype, max_minibatch_kl=1e-9)
    scale0 = float(agent.trainer.scaler.scale[0])
    metrics = []
    agent.learn(callback=lambda a, m: metrics.append(m))
    m = metrics[0]
    taken = int(agent.trainer.scalars[STEP])
    assert taken in (0, 1) and _heads_step(agent) == taken
    # every planned step is taken, skipped by the f16 loss scaler before the stop, or counted as stopped
    planned = TINY["num_minibatches"] * TINY["update_epochs"]
    assert m[KL_STOPPED] >= 1 and m[KL_STOPPED] + m[OVERFLOW_SKIPPED] + taken == planned
    if dtype == "f32":
        assert m[OVERFLOW_SKIPPED] == 0.0
    assert torch.isfinite(_weights(agent)).all()
    if dtype == "f16":  # backed off by the overflows only (growth needs 2000 clean steps)
        scale = scale0 * 0.5 ** m[OVERFLOW_SKIPPED]
        assert float(agent.trainer.scaler.scale[0]) == scale and m["backbone/loss_scale"] == scale
    agent.close()
