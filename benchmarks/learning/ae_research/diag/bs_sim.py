import numpy as np, gymnasium as gym, popgym
from popgym.envs.battleship import BattleshipEasy
rng = np.random.default_rng(0)
def run(policy, n=400):
    rets=[]
    for i in range(n):
        env = BattleshipEasy(); env.reset(seed=i)
        prev=None; hit=False; ret=0; t=0; seen=set()
        while True:
            a = policy(t, prev, hit, seen)
            obs, r, term, trunc, _ = env.step(np.array(a))
            seen.add(tuple(a)); prev=tuple(a); hit=bool(obs); ret+=r; t+=1
            if term or trunc: break
        rets.append(ret)
    return np.mean(rets), np.std(rets)
uni = lambda t,p,h,s: rng.integers(8,size=2)
def noprev(t,p,h,s):
    while True:
        a = tuple(rng.integers(8,size=2))
        if a!=p: return a
def norep(t,p,h,s):
    free=[(i,j) for i in range(8) for j in range(8) if (i,j) not in s]
    return free[rng.integers(len(free))]
sweep = lambda t,p,h,s: (t//8 % 8, t%8)
def hunt_right(t,p,h,s):
    if h and p[1]<7: return (p[0], p[1]+1)
    return tuple(rng.integers(8,size=2))
def hunt_right_wrap(t,p,h,s):
    if h: return (p[0], (p[1]+1)%8)
    return tuple(rng.integers(8,size=2))
for name,pol in [("uniform",uni),("no-prev-repeat",noprev),("no-repeat random",norep),("raster sweep",sweep),("uniform + hunt right",hunt_right),("uniform+hunt right wrap",hunt_right_wrap)]:
    print(name, run(pol))
