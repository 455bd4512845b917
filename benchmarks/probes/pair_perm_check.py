#!/usr/bin/env python3
# Simulation of the pair build's lane-own state order: staging of B in 4 variants, the loads, and the select-free
# transpose-reduce. Checks that every lane ends with the channel sum of (state pair_perm(lane) of its half, dB/dC by lane bit 1).
import numpy as np
rng = np.random.default_rng(0)
N, NP = 16, 8
perm = lambda lane: (lane >> 2) & 7
# per lane (16 channels x 2 halves), per logical state (0..15 of the channel), per c in {dB, dC}: a value
val = rng.standard_normal((32, N, 2))  # val[lane, state, c]: only states gi*8..gi*8+7 of lane's half are used
# staging of one step's B into 4 variants, then each lane's load
B = rng.standard_normal(N)
var = np.zeros((4, N))
for e in range(N):
    for v in range(4):
        var[v, e ^ v] = B[e]
for lane in range(32):
    gi, pm = lane & 1, perm(lane)
    row = var[pm & 3, gi * NP: gi * NP + NP].reshape(2, 4)
    bx = np.concatenate([row[pm >> 2], row[(pm >> 2) ^ 1]])
    for jp in range(NP):
        assert bx[jp] == B[gi * NP + (jp ^ pm)], (lane, jp)
# physical v arrays
w = np.zeros((32, 16))
for lane in range(32):
    gi, pm = lane & 1, perm(lane)
    for jp in range(NP):
        for c in range(2):
            w[lane, 2 * jp + c] = val[lane, gi * NP + (jp ^ pm), c]
for O, half in ((16, 8), (8, 4), (4, 2)):
    nw = w.copy()
    for lane in range(32):
        for k in range(half):
            nw[lane, k] = w[lane, k] + w[lane ^ O, k + half]
    w = nw
out = np.zeros(32)
for lane in range(32):
    hb = (lane >> 1) & 1
    send_partner = w[lane ^ 2, 0] if ((lane ^ 2) >> 1) & 1 else w[lane ^ 2, 1]
    keep = w[lane, 1] if hb else w[lane, 0]
    out[lane] = keep + send_partner
for lane in range(32):
    gi, pm, c = lane & 1, perm(lane), (lane >> 1) & 1
    expect = sum(val[l, gi * NP + pm, c] for l in range(32) if (l & 1) == gi)
    assert abs(out[lane] - expect) < 1e-9, (lane, out[lane], expect)
# every (gi, state, c) is covered exactly once
cov = sorted(((l & 1), perm(l), (l >> 1) & 1) for l in range(32))
assert len(set(cov)) == 32
print("ok: loads and transpose-reduce give each lane the sum for (gi, state pair_perm(lane), c = lane bit 1); all 32 covered once")
