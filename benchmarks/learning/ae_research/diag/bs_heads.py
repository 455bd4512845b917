"""BattleshipEasy (joint 64-cell action): what the harness's reward head and action-set head learn in 200k steps.

Trains one run in-process with popgym.py's settings (8 envs x 128 steps, CPU, one torch thread) and its harness
patch ``--set reward_head=MAC reward_head_q=QC`` (MAC < 0: no reward head), ``joint_action=True`` and, with the
environment variable AS=C, ``action_set_coef=C`` (harness patches when these runs were made, PPOConfig fields
now); extra PPOConfig fields as name=value. Then plays 200 fresh episodes (seeds 10**6 + i)
sampling as in training and prints one JSON line: the MMER of the run, the repeat and hit rates, the reward head's
mean Q0 over the cells already shot / not yet shot (and at the taken cell, repeat or not), the policy's
probability mass on cells already shot, and the action-set head's accuracy over all 64 cells and its recall on the
shot ones.

    AS=1 python benchmarks/learning/ae_research/diag/bs_heads.py -1 1 200000 0 > bs_heads_d_as1.json
    python benchmarks/learning/ae_research/diag/bs_heads.py 6 10 200000 0 layer="'Mamba3'"
"""
import ast
import importlib.util
import json
import os
import sys
import tempfile

import numpy as np
import torch

torch.set_num_threads(1)
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
spec = importlib.util.spec_from_file_location("pg_harness", os.path.join(HERE, "popgym.py"))
H = importlib.util.module_from_spec(spec); spec.loader.exec_module(H)
mac, qc, total, seed = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
extra = dict(a.split("=") for a in sys.argv[5:])
extra = {k: ast.literal_eval(v) for k, v in extra.items()}
if mac >= 0: H._reward_head(mac, qc)
AS = float(os.environ.get("AS", "0"))
task = "popgym-BattleshipEasy-v0"
extra.update(joint_action=True, action_set_coef=AS)
from mamba_rl.agents import RecurrentPPO
from mamba_rl.agents.policy import PolicyState
from mamba_rl.agents.evaluate import reward_scale_of
from mamba_rl.envs import make_vec_env
tmp = tempfile.mkdtemp()
agent = RecurrentPPO(task, seed=seed, total_timesteps=total, num_envs=8, num_steps=128, device="cpu", threads=1,
                     track=False, checkpoint_every=0, checkpoint_dir=tmp, runs_dir=tmp, **extra)
from collections import deque
last = deque(maxlen=100); best = [-9]
def cb(agent, m):
    last.extend(r for _, r, _ in agent.last_episodes)
    if len(last) >= 20: best[0] = max(best[0], sum(last)/len(last))
agent.learn(callback=cb)
p = agent.policy; n = 200
scale = reward_scale_of(agent.envs)
envs = make_vec_env(task, num_envs=n, seed=10**6, joint_action=True)
gen = torch.Generator().manual_seed(1)
obs, _ = envs.reset(seed=10**6)
state = p.initial_state(n); starts = torch.ones(n, dtype=torch.bool)
seen = [set() for _ in range(n)]; done = np.zeros(n, bool)
qrep, qfresh, pmass_shot, rep, shots, hits = [], [], [], 0, 0, 0
qall_shot, qall_fresh = [], []
set_acc, set_acc_shot = [], []
with torch.no_grad():
    for t in range(64):
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
        step_t = torch.where(starts, 0, state.episode_step + 1)
        feat, rec = p._features(x, state, starts, state.prev_reward, step_t)
        raw = p.actor.linear(feat); q = p.actor.q0_head(feat) if mac >= 0 else torch.zeros(n, 64)
        if AS:
            sl = p.action_set(feat).numpy() > 0
            for i in range(n):
                if done[i]: continue
                truth = np.zeros(64, bool); truth[list(seen[i])] = True
                set_acc.append((sl[i] == truth).mean()); set_acc_shot.append(sl[i][truth].mean() if truth.any() else np.nan)
        dist = p.actor.dist(raw); act = dist.sample(gen)
        pr = dist._logps()[0].exp().numpy(); qn = q.numpy()
        for i in range(n):
            if done[i]: continue
            shot = list(seen[i]); fresh = [c for c in range(64) if c not in seen[i]]
            if shot:
                pmass_shot.append(pr[i, shot].sum()); qall_shot.append(qn[i, shot].mean()); qall_fresh.append(qn[i, fresh].mean())
            a = int(act[i, 0]); shots += 1
            if a in seen[i]: rep += 1; qrep.append(qn[i, a])
            else: qfresh.append(qn[i, a])
            seen[i].add(a)
        state = PolicyState(rec, act.clone(), state.prev_reward.clone(), step_t)
        obs, r, term, trunc, _ = envs.step(act.numpy()[:, 0])
        hits += int((np.asarray(r)[~done] > 0).sum())
        state = PolicyState(state.recurrent, state.prev_action, torch.as_tensor((np.asarray(r)*scale).astype(np.float32)), state.episode_step)
        done |= np.asarray(term) | np.asarray(trunc); starts = torch.zeros(n, dtype=torch.bool)
print(json.dumps(dict(mac=mac, qc=qc, seed=seed, mmer=best[0], repeat_rate=rep/shots, hit_rate=hits/shots,
      q_taken_repeat=float(np.mean(qrep)) if qrep else None, q_taken_fresh=float(np.mean(qfresh)),
      q_shot_cells=float(np.mean(qall_shot)), q_fresh_cells=float(np.mean(qall_fresh)),
      pmass_on_shot=float(np.mean(pmass_shot)), set_acc=float(np.mean(set_acc)) if set_acc else None,
      set_recall=float(np.nanmean(set_acc_shot)) if set_acc_shot else None, reward_scale=float(scale), extra=str(extra))))
