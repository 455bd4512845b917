"""How fast a recurrent backbone learns set memory, supervised (issue 24's BattleshipEasy / ConcentrationEasy probe).

BattleshipEasy is won by never shooting a cell twice (+0.075 by simulation against -0.435 for uniform play): the
agent must hold the set of cells it has shot, each given to it once as its previous action. This probe asks the
backbone for that memory without RL: a sequence of T cells drawn uniformly from K (one-hot inputs [B, T, K]), and
after every step the K bits "cell k was seen at or before this step" (binary cross-entropy on a linear readout of
the backbone's features). A batch of fresh random sequences every iteration, Adam, one torch thread.

Backbones: ``mamba1`` / ``mamba3`` (:class:`mamba_rl.MambaBackbone`, ``--set`` overrides of
:class:`mamba_rl.MambaConfig`, CPU backend), ``gru`` / ``lstm`` (torch.nn, hidden ``--d-model``, one layer).
``--a-range lo,hi`` (mamba1 only, a probe-only intervention) sets every layer's ``A_log`` to log(linspace(lo..hi))
over the state index instead of S4D-real's log(1..N), e.g. slow-decaying accumulators with ``0.001,0.5``.

Measured: the loss every ``--every`` iterations, and at the end the accuracy of the bits on a fixed evaluation
batch (seed 12345) over steps 16..T-1 against the majority guess (the share of the more common bit there).

    python benchmarks/learning/set_memory.py --backbone mamba1 --iters 600 --out /tmp/sm_mamba1.json
    python benchmarks/learning/set_memory.py --backbone mamba3 --iters 600 --out /tmp/sm_mamba3.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]  # this folder holds popgym.py

import torch  # noqa: E402
from torch import nn  # noqa: E402


class _Torch(nn.Module):
    """torch.nn.GRU / LSTM, one layer, batch first: features [B, T, hidden]."""

    def __init__(self, kind: str, d_in: int, hidden: int):
        super().__init__()
        self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(d_in, hidden, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.rnn(x)[0], None


def build(backbone: str, k: int, d_model: int, sets: dict, a_range: str | None, seed: int) -> nn.Module:
    """The backbone [B, T, k] -> ([B, T, d_model], _). Raises ValueError on an unknown backbone or a misplaced
    ``--a-range``."""
    if backbone in ("gru", "lstm"):
        if sets or a_range:
            raise ValueError(f"--set / --a-range are for the mamba backbones, got backbone {backbone!r}")
        torch.manual_seed(seed)
        return _Torch(backbone, k, d_model)
    if backbone not in ("mamba1", "mamba3"):
        raise ValueError(f"--backbone: expected mamba1, mamba3, gru or lstm, got {backbone!r}")
    from mamba_rl import MambaBackbone, MambaConfig

    taken = sorted(set(sets) & {"d_model", "layer"})
    if taken:
        raise ValueError(f"--set {taken[0]}: given by --d-model / --backbone, got --set {taken[0]}={sets[taken[0]]!r}")
    cfg = MambaConfig(d_model=d_model, layer="Mamba1" if backbone == "mamba1" else "Mamba3", **sets)
    net = MambaBackbone(cfg, k, seed=seed, backend="cpu")
    if a_range:
        if backbone != "mamba1":
            raise ValueError(f"--a-range is for mamba1 (its A_log [d_inner, d_state]), got {backbone!r}")
        lo, hi = (float(v) for v in a_range.split(","))
        if not 0 < lo <= hi:
            raise ValueError(f"--a-range: expected 0 < lo <= hi, got {a_range!r}")
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name.endswith("mixer.A_log"):
                    p.copy_(torch.linspace(math.log(lo), math.log(hi), p.shape[1]).expand_as(p))
    return net


def batch(gen: torch.Generator, b: int, t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(one-hot cells [b, t, k] float32, seen-so-far bits [b, t, k] float32)."""
    cells = torch.randint(0, k, (b, t), generator=gen)
    x = nn.functional.one_hot(cells, k).float()
    return x, x.cumsum(1).clamp(max=1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbone", required=True)
    ap.add_argument("--cells", type=int, default=64, help="K, the set's universe (BattleshipEasy: 64)")
    ap.add_argument("--steps", type=int, default=64, help="T, the sequence length (BattleshipEasy: 64)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--a-range", default=None)
    ap.add_argument("--set", action="append", default=[], help="a MambaConfig field, name=value")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("diag_memory", os.path.join(HERE, "diag_memory.py"))
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    sets = diag.parse_sets(a.set)  # name=value, the value a Python literal where it parses as one
    try:
        net = build(a.backbone, a.cells, a.d_model, sets, a.a_range, a.seed)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    head = nn.Linear(a.d_model, a.cells)
    params = list(net.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=a.lr)
    gen = torch.Generator().manual_seed(a.seed)
    curve, t0 = [], time.time()
    for it in range(a.iters + 1):
        x, seen = batch(gen, a.batch, a.steps, a.cells)
        loss = nn.functional.binary_cross_entropy_with_logits(head(net(x)[0]), seen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if it % a.every == 0:
            curve.append([it, round(loss.item(), 5), round(time.time() - t0, 1)])
            print(f"{a.backbone} it {it} loss {loss.item():.4f} {time.time() - t0:.0f} s", flush=True)
    with torch.no_grad():
        x, seen = batch(torch.Generator().manual_seed(12345), 256, a.steps, a.cells)
        logit = head(net(x)[0])
        late = slice(16, a.steps)
        acc = ((logit[:, late] > 0).float() == seen[:, late]).float().mean().item()
        share = seen[:, late].mean().item()
        eval_loss = nn.functional.binary_cross_entropy_with_logits(logit, seen).item()
    res = dict(backbone=a.backbone, sets=sets, a_range=a.a_range, cells=a.cells, steps=a.steps, batch=a.batch,
               iters=a.iters, lr=a.lr, d_model=a.d_model, seed=a.seed, curve=curve, eval_loss=round(eval_loss, 5),
               eval_acc_late=round(acc, 4), majority_late=round(max(share, 1 - share), 4),
               params=sum(p.numel() for p in params), wall_s=round(time.time() - t0, 1), torch=torch.__version__)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("backbone", "eval_loss", "eval_acc_late", "majority_late", "wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
