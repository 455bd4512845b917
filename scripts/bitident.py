"""Fixed-seed 3-update training run; prints a SHA-256 of the final weights (bit-identity check of refactors).

    python scripts/bitident.py                 # CPU (default backend: the cpu kernels)
    python scripts/bitident.py --device cuda   # CUDA (graph-captured rollout and update)

Run it before and after a change that must not change behaviour: the hashes must be equal. The hash covers
the backbone's master arena, the heads' parameters and both optimizers' moments (in that order, as raw
little-endian bytes), so any change of a single bit of the trained state shows. The run uses the previous
action and reward inputs, observation and reward normalisation and two epochs of two minibatches, so the
staging, GAE, the update and the head optimizer all feed the hash.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile

import torch


def weights_hash(agent) -> str:
    """SHA-256 (hex) of the master arena, the head parameters and both optimizers' moments."""
    h = hashlib.sha256()
    tensors = [agent.trainer.net.arena, *agent.policy.heads.parameters(), agent.trainer.exp_avg,
               agent.trainer.exp_avg_sq]
    for state in agent.head_optimizer.state_dict()["state"].values():
        tensors += [torch.as_tensor(state[k]) for k in sorted(state)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    ap.add_argument("--backend", default="auto", help="auto | cpu | cuda | reference (default: auto)")
    args = ap.parse_args(argv)
    from mamba_rl.agents import PPOConfig, RecurrentPPO

    with tempfile.TemporaryDirectory() as tmp:
        cfg = PPOConfig(env_id="mamba_rl/CartPoleNoVel-v1", seed=3, device=args.device, backend=args.backend,
                        num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, total_timesteps=3 * 4 * 32,
                        prev_action=True, prev_reward=True, normalize_obs=True, track=False, checkpoint_every=0,
                        runs_dir=f"{tmp}/runs", checkpoint_dir=f"{tmp}/ckpt", threads=1)
        cfg = cfg.replace(d_model=32, n_layers=2, d_state=8)
        agent = RecurrentPPO(config=cfg)
        agent.learn()
        digest = weights_hash(agent)
        backend = agent.trainer.net.backend
        agent.close()
    print(f"{digest}  device={args.device} backend={backend} updates=3")
    return 0


if __name__ == "__main__":
    sys.exit(main())
