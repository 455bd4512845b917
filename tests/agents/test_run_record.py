"""What a run records about itself: the backend and device that actually ran (not the requested "auto"), in the
TensorBoard hyperparameters, so a reference-fallback run can be told apart from a kernel run."""
from mamba_rl.agents import PPOConfig, RecurrentPPO


def test_tensorboard_records_the_backend_that_ran(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = PPOConfig(num_envs=2, num_steps=16, num_minibatches=1, update_epochs=1, d_model=16, n_layers=1, d_state=4,
                    device="cpu", seed=3, total_timesteps=32, checkpoint_every=0, runs_dir=str(tmp_path / "runs"),
                    checkpoint_dir=str(tmp_path / "ckpt"))
    agent = RecurrentPPO("CartPole-v1", config=cfg)
    agent.learn()
    ran = agent.policy.net.backend
    agent.close()
    acc = EventAccumulator(str(tmp_path / "runs" / agent.run_name), size_guidance={"tensors": 0})
    acc.Reload()
    text = b"".join(b"".join(e.tensor_proto.string_val) for tag in acc.Tags()["tensors"] for e in acc.Tensors(tag))
    assert f"|backend|auto (ran: {ran})|".encode() in text
    assert b"|device|cpu (ran: cpu)|" in text
