"""mamba_rl vs its peers on one GPU, in one process (see benchmarks/README.md for the committed table).

Times (median µs per call, CUDA events, graphs where a model can use them, TF32 off):
  * the training step (fwd over [B, T] + bwd with a given d_temporal + AdamW) of mamba_rl's
    MambaTrainer in f32 and bf16, as graph replay and through the public ``trainer.step`` call;
  * the one-token step of the graph-captured Stepper (replay and ``stepper.step``), and the fused
    kernel alone at each rows-per-block setting;
  * the peers by running the project's peer script (kept outside the repository; copy it to the
    git-ignored .peers/peers.py) in this process: cuDNN LSTM / GRU and mambapy (wheel carried in .whl).
Also the peak GPU memory and the kernels per captured graph (torch.profiler over one replay).

Usage (device): python3 benchmarks/bench.py --out $OUT/bench.json [--no-peers] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

OBS, DM, L = 32, 128, 3
SHAPES = [(16, 64), (64, 128), (256, 32)]
INFER_B = [1, 16, 256]


def timeit(fn, iters, warm=5):
    """Median µs per call; events around every call (the peers' method)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def count_kernels(fn):
    """GPU kernels, memcpys and memsets executed by one call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n = 0
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            n += 1
    return n


def kernel_profile(fn, top=25):
    """Per-kernel GPU time of one call (torch.profiler), largest first: [(name, count, total µs)]."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    agg = {}
    for ev in prof.events():
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
            k = ev.name[:90]
            c, t = agg.get(k, (0, 0.0))
            agg[k] = (c + 1, t + ev.device_time_total if hasattr(ev, "device_time_total") else t + ev.cuda_time_total)
    rows = sorted(((k, c, round(t, 2)) for k, (c, t) in agg.items()), key=lambda r: -r[2])
    return rows[:top]


def bench_train(B, T, dtype, iters, profile_it=False):
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl import MambaTrainer
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    net = MambaBackbone(MambaConfig(d_model=DM, n_layers=L), OBS, device="cuda", seed=0, backend="cuda")
    tr = MambaTrainer(net, batch=B, seq_len=T, dtype=dtype, lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(0)
    tr.x_buf.copy_(torch.randn(B, T, OBS, device="cuda", generator=g))
    tr.d_buf.copy_(torch.randn(B, T, DM, device="cuda", generator=g))
    eager = timeit(lambda: tr.step(None, None), max(5, iters // 3))
    tr.capture_graph()
    graph = tr._graphs["step"]
    api = timeit(lambda: tr.step(None, None), iters)
    replay = timeit(graph.replay, iters)
    nk = count_kernels(graph.replay)
    prof = kernel_profile(graph.replay) if profile_it else None
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    del tr, net, graph
    r = dict(kind="train", model=f"mamba_rl_{dtype}", B=B, T=T, graph=True, us=replay, api_us=api,
             eager_us=eager, kernels=nk, peak_mib=round(peak, 1))
    if prof:
        r["profile"] = prof
    return r


def bench_infer(B, iters):
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.ops.step import backbone_step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    net = MambaBackbone(MambaConfig(d_model=DM, n_layers=L), OBS, device="cuda", seed=0, backend="cuda")
    st = net.stepper(batch=B)
    x = torch.randn(B, OBS, device="cuda")
    st.capture_graph()
    api = timeit(lambda: st.step(x), iters)
    replay = timeit(lambda: st.step(None), iters)
    nk = count_kernels(lambda: st.step(None))
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    rows = [dict(kind="infer", model="mamba_rl", B=B, T=1, graph=True, us=replay, api_us=api, kernels=nk,
                 peak_mib=round(peak, 1))]
    # the fused kernel alone, per rows-per-block setting, captured
    w = net.step_weights()
    cs, ss = st.state.conv.clone(), st.state.ssm.clone()
    starts = torch.zeros(B, dtype=torch.bool, device="cuda")
    ext = net.kernels
    for kernel in ("rows", "cluster"):
        for R in (1, 2, 4, 8):
            gr = torch.cuda.CUDAGraph()
            backbone_step(ext, x, w, cs, ss, starts, net.cfg, kernel=kernel, rows_per_block=R)
            torch.cuda.synchronize()
            with torch.cuda.graph(gr):
                backbone_step(ext, x, w, cs, ss, starts, net.cfg, kernel=kernel, rows_per_block=R)
            name = f"backbone_step_R{R}" if kernel == "rows" else f"backbone_step_cluster_R{R}"
            rows.append(dict(kind="infer_kernel", model=name, B=B, T=1, graph=True, us=timeit(gr.replay, iters)))
    return rows


def run_peers(out_dir):
    src = ROOT / ".peers" / "peers.py"
    if not src.exists():
        print("bench: .peers/peers.py missing; peers skipped", flush=True)
        return []
    spec = importlib.util.spec_from_file_location("peers", src)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    old = os.environ.get("OUT")
    os.environ["OUT"] = str(out_dir)
    try:
        peers.main()
    finally:
        if old is None:
            os.environ.pop("OUT", None)
        else:
            os.environ["OUT"] = old
    return json.load(open(Path(out_dir) / "peers.json"))["rows"]


def table(rows):
    ours = {(r["kind"], r["B"], r["T"], r["model"]): r for r in rows if r["model"].startswith("mamba_rl")}
    peer = {}
    for r in rows:
        if not r["model"].startswith(("mamba_rl", "backbone_step")) and r.get("graph") and r["us"] == r["us"]:
            peer[(r["kind"], r["B"], r["T"], r["model"])] = r["us"]
    lines = []
    names = sorted({k[3] for k in peer})
    lines.append("| kind | B x T | mamba_rl | µs (graph replay) | public call µs | kernels | peak MiB | "
                 + " | ".join(f"{n} µs (ratio)" for n in names) + " |")
    lines.append("|" + "---|" * (7 + len(names)))
    for (kind, B, T, model), r in sorted(ours.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3])):
        cells = []
        for n in names:
            p = peer.get((kind, B, T, n))
            cells.append("-" if p is None else f"{p:.0f} ({p / r['us']:.1f}x)")
        lines.append(f"| {kind} | {B} x {T} | {model} | {r['us']:.1f} | {r.get('api_us', float('nan')):.1f} | "
                     f"{r.get('kernels', '-')} | {r.get('peak_mib', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["train", "infer"], default=None)
    a = ap.parse_args(argv)
    assert torch.cuda.is_available(), "bench needs a GPU"
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    iters = 30 if a.quick else 100
    rows = []
    for B, T in (SHAPES if a.only != "infer" else []):
        for dt in ("f32", "bf16"):
            try:
                rows.append(bench_train(B, T, dt, iters, profile_it=(dt == "f32")))
            except Exception as e:  # record and keep going
                rows.append(dict(kind="train", model=f"mamba_rl_{dt}", B=B, T=T, graph=True, us=float("nan"),
                                 err=repr(e)[:300]))
            print({k: v for k, v in rows[-1].items() if k != "profile"}, flush=True)
            for pr in rows[-1].get("profile", []):
                print(f"    {pr[2]:9.1f} us  x{pr[1]:<3d} {pr[0]}", flush=True)
    for B in (INFER_B if a.only != "train" else []):
        try:
            rows += bench_infer(B, 200 if not a.quick else 50)
        except Exception as e:
            rows.append(dict(kind="infer", model="mamba_rl", B=B, T=1, graph=True, us=float("nan"),
                             err=repr(e)[:300]))
        print(rows[-4:] if len(rows) >= 4 else rows, flush=True)
    if not a.no_peers:
        rows += run_peers(out.parent)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    json.dump(res, open(out, "w"), indent=1)
    print("\n" + table(rows), flush=True)


if __name__ == "__main__":
    main()
