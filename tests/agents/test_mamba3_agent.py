"""RecurrentPPO with ``layer="Mamba3"`` on the CPU: the backbone runs the C++ Mamba-3 kernels (backend auto),
the agent trains, and a run resumed from a checkpoint continues with the same losses."""
import torch

from mamba_rl.agents import PPOConfig, RecurrentPPO
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels()


def test_mamba3_agent_trains_on_the_cpu_kernels_and_resumes_exactly(tmp_path):
    cfg = PPOConfig(layer="Mamba3", headdim=8, num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2,
                    d_model=16, n_layers=2, d_state=8, device="cpu", seed=3, total_timesteps=4 * 64,
                    checkpoint_every=1, runs_dir=str(tmp_path / "runs"), checkpoint_dir=str(tmp_path / "ckpt"))
    straight = RecurrentPPO("mamba_rl/CartPoleNoVel-v1", config=cfg)
    assert straight.policy.net.backend == "cpu" and straight.policy.net.cfg.layer == "Mamba3"
    straight.learn()
    straight.close()
    ckpt = tmp_path / "ckpt" / straight.run_name / "update_000002"
    resumed = RecurrentPPO.load(ckpt, restore_envs=True)
    assert resumed.policy.net.backend == "cpu"
    resumed.learn()
    resumed.close()
    keys = [k for k in straight.history[0] if k.startswith("losses/")]
    assert keys and len(resumed.history) == 2
    for a, b in zip(straight.history[2:], resumed.history):
        for k in keys:
            assert a[k] == b[k], k  # the same losses, to the bit
    assert torch.equal(resumed.policy.net.arena, straight.policy.net.arena)  # the final weights, to the bit
