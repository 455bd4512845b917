"""What a RecurrentPPO agent has learned on POPGym's AutoencodeEasy and BattleshipEasy (issue 24's diagnosis).

Trains one run in-process with the popgym.py harness's settings (8 envs x 128 steps, CPU, one torch thread,
``--set`` overrides of PPOConfig fields) and, at the env steps given by ``--at``, plays ``--episodes`` fresh
episodes (a vector env of that many copies, seeds 10**6 + i, the memory reset per episode) with the current policy,
sampling as in training (``--greedy`` adds the mode's numbers):

* AutoencodeEasy: 52 cards are shown one per step (WATCH); then the agent names their suits in reverse order
  (PLAY). The k-th answer (k = 1..52) is the card shown 2(k-1) steps before the observation it answers on (k = 1: the
  card is still on show). Per k: the accuracy of the sampled answer and the mean probability the policy gives the
  right suit (0.25 = no memory); the episode return.
* BattleshipEasy: per episode the fraction of shots at a cell fired at before (repeat rate), the hit rate over all
  shots, over the shots that follow a hit and over those that follow a miss, the fraction of shots next to (4-
  neighbour of) the last hit while that hit is the previous shot, the episode return and length.

Usage (from the repo root):
    python benchmarks/learning/diag_memory.py --task AutoencodeEasy --seed 0 --total 200000 \\
        --at 0 100000 200000 --episodes 200 --out /tmp/diag/ae_s0.json [--set aux_gamma=0.0 ...]
Prints one table per diagnosis point and writes every number to ``--out`` (JSON), with the MMER curve.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import tempfile
import time
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]  # this folder holds popgym.py

import numpy as np  # noqa: E402
import torch  # noqa: E402


def parse_sets(items):
    out = {}
    for item in items:
        k, _, v = item.partition("=")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


class Player:
    """Steps the agent's policy on a batch of envs and returns per-step logits, actions, rewards, observations."""

    def __init__(self, agent, env_id: str, n: int, seed: int):
        from mamba_rl.agents.evaluate import reward_scale_of
        from mamba_rl.envs import make_vec_env

        self.agent, self.policy, self.n = agent, agent.policy, n
        self.reward_scale = reward_scale_of(agent.envs)  # the previous-reward input, as training scales it
        self.envs = make_vec_env(env_id, num_envs=n, seed=seed)
        self.seed = seed

    @torch.no_grad()
    def play(self, steps: int, greedy: bool, gen: torch.Generator):
        from mamba_rl.agents.policy import PolicyState

        p, n = self.policy, self.n
        obs, _ = self.envs.reset(seed=self.seed)
        state = p.initial_state(n)
        starts = torch.ones(n, dtype=torch.bool)
        O, A, R, D, L = [], [], [], [], []
        done = np.zeros(n, dtype=bool)
        for _ in range(steps):
            x = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
            step_t = torch.where(starts, 0, state.episode_step + 1)
            feat, rec = p._features(x, state, starts, state.prev_reward, step_t)
            raw = p.actor.linear(feat).cpu()
            dist = p.actor.dist(raw, p.host_log_std())
            act = dist.mode() if greedy else dist.sample(gen)
            state = PolicyState(rec, act.clone(), state.prev_reward.clone(), step_t)
            env_act = p.stager(n).to_env(act.numpy())
            O.append(np.asarray(obs).copy())
            L.append([lp.numpy().copy() for lp in dist._logps()])
            A.append(act.numpy().copy())
            D.append(done.copy())  # done before this step: the step is not part of the first episode
            obs, r, term, trunc, _ = self.envs.step(env_act)
            state = PolicyState(state.recurrent, state.prev_action,
                                torch.as_tensor((np.asarray(r, np.float64) * self.reward_scale).astype(np.float32)),
                                state.episode_step)
            R.append(np.asarray(r, dtype=np.float64))
            done = done | np.asarray(term) | np.asarray(trunc)
            starts = torch.zeros(n, dtype=torch.bool)
        return O, L, A, R, D

    def close(self):
        self.envs.close()


def diag_autoencode(player: Player, greedy: bool, gen) -> dict:
    O, L, A, R, D = player.play(103, greedy, gen)
    suits = np.stack([o[:, 2:6].argmax(1) for o in O[:52]], 1)  # [n, 52]: the card on show at obs index 0..51
    acc, pc, rew_ok = [], [], []
    for k in range(1, 53):
        t = 51 + k - 1  # the observation index (0-based step) of the k-th answer
        right = suits[:, 52 - k]
        logp = L[t][0]
        acc.append(float(np.mean(A[t][:, 0] == right)))
        pc.append(float(np.mean(np.exp(logp[np.arange(len(right)), right]))))
        rew_ok.append(float(np.mean(R[t] > 0)))
    assert np.allclose(acc, rew_ok), "the answer indexing disagrees with the env's rewards"
    ret = np.sum(np.stack(R[:103], 1), 1)
    return {"acc": acc, "p_correct": pc, "return": float(ret.mean()), "return_std": float(ret.std())}


def diag_battleship(player: Player, greedy: bool, gen) -> dict:
    O, L, A, R, D = player.play(64, greedy, gen)
    n = player.n
    A = np.stack(A, 1)  # [n, 64, 2]
    R = np.stack(R, 1)
    live = ~np.stack(D, 1)  # [n, 64] steps of the first episode
    hit = R > 0
    shots = rep = hits = 0
    after_hit = [0, 0]
    after_miss = [0, 0]
    adj_after_hit = [0, 0]
    rets, lens = [], []
    for i in range(n):
        seen = set()
        ret = 0.0
        m = int(live[i].sum())
        for t in range(m):
            cell = (int(A[i, t, 0]), int(A[i, t, 1]))
            shots += 1
            rep += cell in seen
            seen.add(cell)
            hits += bool(hit[i, t])
            ret += R[i, t]
            if t > 0:
                bucket = after_hit if hit[i, t - 1] else after_miss
                bucket[0] += 1
                bucket[1] += bool(hit[i, t])
                if hit[i, t - 1]:
                    pr = (int(A[i, t - 1, 0]), int(A[i, t - 1, 1]))
                    adj_after_hit[0] += 1
                    adj_after_hit[1] += abs(pr[0] - cell[0]) + abs(pr[1] - cell[1]) == 1
        rets.append(ret)
        lens.append(m)
    # the spread of the first shot: how concentrated the policy's cells are (distinct cells in the first 16 shots)
    distinct16 = float(np.mean([len({(int(a), int(b)) for a, b in A[i, :16]}) for i in range(n)]))
    return {"repeat_rate": rep / shots, "hit_rate": hits / shots,
            "hit_after_hit": after_hit[1] / max(after_hit[0], 1), "hit_after_miss": after_miss[1] / max(after_miss[0], 1),
            "adjacent_after_hit": adj_after_hit[1] / max(adj_after_hit[0], 1), "distinct_in_first16": distinct16,
            "return": float(np.mean(rets)), "return_std": float(np.std(rets)), "length": float(np.mean(lens))}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", required=True, choices=["AutoencodeEasy", "BattleshipEasy"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--total", type=int, default=200_000)
    ap.add_argument("--at", type=int, nargs="+", default=[0, 200_000], help="env steps at which to diagnose")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from mamba_rl.agents import RecurrentPPO

    sets = parse_sets(a.set)
    tmp = tempfile.mkdtemp(prefix="diag_")
    kw = dict(seed=a.seed, total_timesteps=a.total, num_envs=8, num_steps=128, device="cpu", threads=1, track=False,
              checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp)
    kw.update(sets)
    agent = RecurrentPPO(f"popgym-{a.task}-v0", **kw)
    player = Player(agent, f"popgym-{a.task}-v0", a.episodes, 10**6)
    fn = diag_autoencode if a.task == "AutoencodeEasy" else diag_battleship
    todo = sorted(a.at)
    results, curve = [], []
    last = deque(maxlen=100)
    t0 = time.time()

    def run_diag(step):
        rec = {"step": step, "sampled": fn(player, False, torch.Generator().manual_seed(7))}
        if a.greedy:
            rec["greedy"] = fn(player, True, None)
        results.append(rec)
        s = rec["sampled"]
        if a.task == "AutoencodeEasy":
            print(f"[{step:>8}] return {s['return']:+.3f}  acc k=1..10 " + " ".join(f"{v:.2f}" for v in s["acc"][:10])
                  + "  p(correct) k=1..10 " + " ".join(f"{v:.2f}" for v in s["p_correct"][:10])
                  + f"  mean acc k=11..52 {np.mean(s['acc'][10:]):.3f}", flush=True)
            if a.greedy:
                g = rec["greedy"]
                print(f"[{step:>8}] greedy return {g['return']:+.3f} acc k=1..10 "
                      + " ".join(f"{v:.2f}" for v in g["acc"][:10]), flush=True)
        else:
            print(f"[{step:>8}] " + "  ".join(f"{k} {v:.3f}" for k, v in s.items()), flush=True)
            if a.greedy:
                print(f"[{step:>8}] greedy " + "  ".join(f"{k} {v:.3f}" for k, v in rec["greedy"].items()), flush=True)

    while todo and todo[0] <= 0:
        run_diag(0)
        todo.pop(0)

    def callback(agent, metrics):
        rets = [r for _, r, _ in agent.last_episodes]
        last.extend(rets)
        step = int(metrics["global_step"])
        curve.append((step, sum(last) / len(last) if last else math.nan))
        while todo and step >= todo[0]:
            todo.pop(0)
            run_diag(step)

    agent.learn(callback=callback)
    if todo:
        run_diag(agent.global_step)
    mm = max((v for _, v in curve if not math.isnan(v)), default=math.nan)
    print(f"MMER {mm:.4f}  wall {time.time() - t0:.0f} s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"task": a.task, "seed": a.seed, "total": a.total, "set": {k: repr(v) for k, v in sets.items()},
                   "mmer": mm, "curve": curve, "diag": results}, f)
    player.close()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
