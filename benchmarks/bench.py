"""mamba_rl vs cuDNN GRU / LSTM on one GPU, in one process (see benchmarks/README.md for the committed table).

Times (median µs per call, CUDA events around every call, graph replays, TF32 off):
  * the training step (fwd over [B, T] + bwd with a given d_temporal + AdamW) of mamba_rl's MambaTrainer
    in f32 and bf16 (3 layers, d_state 16, expand 2), as graph replay and through the public
    ``trainer.step`` call, for every (d_model, B, T) row of ``ROWS``;
  * the same step of cuDNN GRU-1L, LSTM-1L and LSTM-3L (nn.GRU / nn.LSTM of hidden d_model behind an input
    Linear, fused capturable AdamW, graph replay: the method of the project's peer script) at every row;
  * the one-token step of the graph-captured Stepper (replay and ``stepper.step``) at the default model,
    the fused kernel alone at each rows-per-block setting, and the peers' one-token step.
The same training and one-token rows for ``layer="Mamba3"`` (models ``mamba3_<dtype>`` / ``mamba3``; skip them
with ``--no-mamba3``). Also the peak GPU memory and the kernels per captured graph (torch.profiler over one replay), with a
per-kernel profile and the launch-order kernel list (``kernel_seq``) at the ``PROFILED`` rows. ``--variants``
also times each training row with the small-GEMM kernels of ``mamba_rl.model.fused`` forced off / partly / fully
on (models ``mamba_rl_<dtype>_torchgemm`` / ``_xdtonly`` / ``_gemmon``); ``--stream-ab`` times each training row
again with the weight gradients in the kernel chain instead of on their second stream (``mamba_rl_<dtype>_chain``,
``fused.WGRAD_STREAM = "off"``). Other configurations side by side: ``benchmarks/ab_configs.py``. The one-token
rows add the bare graph replay (``raw_graph_us``), the host time to issue one call (``host_api_us``,
``host_replay_us``) and, for ours and the peers, the GPU time of one step with the host out of the way (``gpu_us``:
20 steps in one graph, its replay divided by 20; the replay's ``us`` includes the host's issue time, as the peers'
method has it). Every row carries ``d_model``.

``--rounds N`` runs every row N times in turn in the same process (ours and the peers alike) and reports, for each
row, the median of its N medians (the rounds' own values in ``us_rounds``): one noisy round, often a process's first
rows, then moves no ratio. The per-kernel profiles and the one-token kernel sweep are taken in the first round only.

Usage (device): python3 benchmarks/bench.py --out $OUT/bench.json [--quick] [--only train|infer] [--rows N]
    [--variants] [--stream-ab] [--no-step-kernels] [--rounds N]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

OBS, DM, L = 32, 128, 3
# (d_model, B, T): the shapes benchmarks/README.md reports (short and long T, wide models)
ROWS = [(128, 16, 64), (128, 64, 128), (128, 256, 32), (128, 16, 512), (128, 16, 2048), (128, 64, 1024),
        (128, 4, 4096), (256, 64, 128), (512, 64, 128), (512, 16, 512), (1024, 64, 128)]
INFER_B = [1, 16, 256]
PROFILED = ((128, 16, 64), (128, 64, 128), (128, 4, 4096))  # rows with a per-kernel profile (and kernel_seq)
PEERS = {"gru1": ("GRU", 1), "lstm1": ("LSTM", 1), "lstm3": ("LSTM", 3)}


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


def host_us(fn, iters):
    """Median host-side µs to issue one call (perf_counter around the call, synchronised before each)."""
    import time
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
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


def kernel_sequence(fn):
    """Names of the GPU kernels / memcpys of one call in launch order (torch.profiler), shortened."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [ev for ev in prof.events() if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda ev: ev.time_range.start)
    return [ev.name[:60] for ev in evs]


# (name suffix, fused.WGRAD, fused.XDT): the small-GEMM kernels as chosen ("auto"), forced off (the torch
# GEMMs of the version before) and forced on, timed in the same process (--variants)
VARIANTS = {"": ("auto", "auto"), "_torchgemm": ("off", "off"), "_xdtonly": ("off", "on"), "_gemmon": ("on", "on"),
            "_wgradon": ("on", "auto")}
MODEL = {"Mamba1": "mamba_rl", "Mamba3": "mamba3"}  # row name prefix per layer kind


# fused-node switches bench_train(fused_flags=...) may set (each restored to its previous value afterwards)
FUSED_FLAGS = ("CONV_XDT", "INPUT_NORM", "OUT_PROJ_LT", "FINAL_DIRECT", "NORM_F_FUSED", "WGRAD_SLICE", "CONV_DW",
               "NORM_DW")


def bench_train(dm, B, T, dtype, iters, profile_it=False, variant="", layer="Mamba1", wgrad_stream="auto",
                tensor_cores=True, optim_fused=True, coop=7, fused_flags=None, tag="", bwd_blocks=0):
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl import MambaTrainer
    from mamba_rl.model import fused
    from mamba_rl.ops import optim
    fused_flags = fused_flags or {}
    for k in fused_flags:
        if k not in FUSED_FLAGS:
            raise ValueError(f"bench_train: fused_flags: expected names in {sorted(FUSED_FLAGS)}, got {k!r}")
    flags_before = {k: getattr(fused, k) for k in fused_flags}
    ext = None
    try:  # every switch below is process-wide: restored however the row ends (ab_configs goes on after a failure)
        optim.FUSED = optim_fused
        fused.WGRAD, fused.XDT = VARIANTS[variant]
        fused.WGRAD_STREAM = wgrad_stream
        fused.WGRAD_TENSOR_CORES = tensor_cores
        for k, v in fused_flags.items():
            setattr(fused, k, v)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        net = MambaBackbone(MambaConfig(d_model=dm, n_layers=L, layer=layer), OBS, device="cuda", seed=0,
                            backend="cuda")
        ext = net.kernels
        if hasattr(ext, "set_coop"):
            ext.set_coop(coop)
        if bwd_blocks:  # the scan backward's build forced (csrc/scan.cu scan_bwd_config; 0: its rule)
            ext.scan_set_bwd_blocks(bwd_blocks)
        tr = MambaTrainer(net, batch=B, seq_len=T, dtype=dtype, lr=1e-3)
        g = torch.Generator(device="cuda").manual_seed(0)
        tr.x_buf.copy_(torch.randn(B, T, OBS, device="cuda", generator=g))
        tr.d_buf.copy_(torch.randn(B, T, dm, device="cuda", generator=g))
        eager = timeit(lambda: tr.step(None, None), max(5, iters // 3))
        tr.capture_graph()
        graph = tr._graphs["step"]
        api = timeit(lambda: tr.step(None, None), iters)
        replay = timeit(graph.replay, iters)
        nk = count_kernels(graph.replay)
        prof = kernel_profile(graph.replay) if profile_it else None
        seq = kernel_sequence(graph.replay) if profile_it else None
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    finally:
        if ext is not None and hasattr(ext, "set_coop"):
            ext.set_coop(7)
        if ext is not None and bwd_blocks:
            ext.scan_set_bwd_blocks(0)
        fused.WGRAD, fused.XDT = VARIANTS[""]
        fused.WGRAD_STREAM = "auto"
        fused.WGRAD_TENSOR_CORES = True
        for k, v in flags_before.items():
            setattr(fused, k, v)
        optim.FUSED = True
    variant += tag + {"off": "_chain", "on": "_streamon"}.get(wgrad_stream, "") + ("" if tensor_cores else "_notc") + \
        ("" if optim_fused else "_optsplit") + ("" if coop == 7 else f"_coop{coop}") + \
        (f"_bwd{bwd_blocks}" if bwd_blocks else "")
    r = dict(kind="train", model=f"{MODEL[layer]}_{dtype}{variant}", d_model=dm, B=B, T=T, graph=True, us=replay,
             api_us=api, eager_us=eager, kernels=nk, peak_mib=round(peak, 1))
    if prof:
        r["profile"] = prof
    if seq:
        r["kernel_seq"] = seq
    return r


def bench_infer(B, iters, step_kernels=True, layer="Mamba1"):
    from mamba_rl import MambaBackbone, MambaConfig
    from mamba_rl.graphs import restore, snapshot
    from mamba_rl.ops.step import backbone_step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    net = MambaBackbone(MambaConfig(d_model=DM, n_layers=L, layer=layer), OBS, device="cuda", seed=0, backend="cuda")
    st = net.stepper(batch=B)
    x = torch.randn(B, OBS, device="cuda")
    st.capture_graph()
    api = timeit(lambda: st.step(x), iters)
    replay = timeit(lambda: st.step(None), iters)
    raw = timeit(st._graphs["step"].replay, iters)  # the bare graph launch, no Python around it
    st.x_buf.copy_(x)
    st.starts_buf.zero_()
    host = host_us(lambda: st.step(x), iters)
    host_replay = host_us(lambda: st.step(None), iters)
    nk = count_kernels(lambda: st.step(None))
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    saved = snapshot((st.state.conv, st.state.ssm))
    try:  # the step's graph body (Stepper.capture_graph) GPU_REPS times in one graph
        with torch.no_grad():
            gpu = gpu_us(lambda: net.step(st.x_buf, st.state, st.starts_buf), iters)
    except Exception as e:  # recorded, not fatal to the row
        traceback.print_exc()
        gpu = float("nan")
        print(f"bench_infer: gpu_us failed: {e!r}", flush=True)
    restore(saved)
    rows = [dict(kind="infer", model=MODEL[layer], d_model=DM, B=B, T=1, graph=True, us=replay, api_us=api,
                 raw_graph_us=raw, gpu_us=gpu, host_api_us=host, host_replay_us=host_replay,
                 fast_launch=getattr(st, "_fast", None) is not None, kernels=nk, peak_mib=round(peak, 1))]
    if not step_kernels or layer != "Mamba1":
        return rows
    # the fused kernel alone, per rows-per-block setting, captured
    w = net.step_weights()
    cs, ss = st.state.conv.clone(), st.state.ssm.clone()
    starts = torch.zeros(B, dtype=torch.bool, device="cuda")
    ext = net.kernels
    for kernel in ("rows", "cluster", "cluster_normpass", "cluster2", "cluster3"):
        for R in {"cluster2": (1, 2, 4, 8, 16), "cluster3": (8, 16, 32)}.get(kernel, (1, 2, 4, 8)):
            gr = torch.cuda.CUDAGraph()
            backbone_step(ext, x, w, cs, ss, starts, net.cfg, kernel=kernel, rows_per_block=R)
            torch.cuda.synchronize()
            with torch.cuda.graph(gr):
                backbone_step(ext, x, w, cs, ss, starts, net.cfg, kernel=kernel, rows_per_block=R)
            name = ("backbone_step" if kernel == "rows" else f"backbone_step_{kernel}") + f"_R{R}"
            rows.append(dict(kind="infer_kernel", model=name, d_model=DM, B=B, T=1, graph=True,
                             us=timeit(gr.replay, iters)))
    return rows


class RNNBackbone(nn.Module):
    """The peer: input Linear + cuDNN nn.GRU / nn.LSTM of hidden d_model (the project's peer script)."""

    def __init__(self, cell, obs, d, layers):
        super().__init__()
        self.inp = nn.Linear(obs, d)
        self.rnn = getattr(nn, cell)(d, d, num_layers=layers, batch_first=True)

    def forward(self, x, h=None):
        return self.rnn(self.inp(x), h)


GPU_REPS = 20  # one-token steps in one graph for gpu_us


def gpu_us(fn, iters, reps=GPU_REPS):
    """Median µs of one call of ``fn`` with the host out of the way: ``reps`` calls captured in one graph, its
    replay timed (events around it) and divided by ``reps``. ``fn`` must be capturable; it runs 3 x reps times
    before the capture (warm-up), so a caller restores what it changes. Separates a one-token step's GPU time from
    the host's issue time, which the events around each single replay (``timeit``) include."""
    return timeit(_capture(lambda: [fn() for _ in range(reps)]), iters) / reps


def _capture(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return gr.replay


def bench_peer_train(name, dm, B, T, iters):
    cell, layers = PEERS[name]
    torch.manual_seed(0)
    m = RNNBackbone(cell, OBS, dm, layers).cuda()
    x = torch.randn(B, T, OBS, device="cuda")
    g = torch.randn(B, T, dm, device="cuda")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)

    def step():
        opt.zero_grad(set_to_none=False)
        y, _ = m(x)
        y.backward(g)
        opt.step()
    replay = _capture(step)
    return dict(kind="train", model=name, d_model=dm, B=B, T=T, graph=True, us=timeit(replay, iters))


def bench_peer_infer(name, B, iters):
    cell, layers = PEERS[name]
    torch.manual_seed(0)
    m = RNNBackbone(cell, OBS, DM, layers).cuda()
    x = torch.randn(B, 1, OBS, device="cuda")
    h = torch.zeros(layers, B, DM, device="cuda")
    hc = (h, torch.zeros_like(h)) if cell == "LSTM" else h

    @torch.no_grad()
    def f():
        y, hn = m(x, hc)
        if isinstance(hn, tuple):
            hc[0].copy_(hn[0]); hc[1].copy_(hn[1])
        else:
            hc.copy_(hn)
        return y
    return dict(kind="infer", model=name, d_model=DM, B=B, T=1, graph=True, us=timeit(_capture(f), iters),
                gpu_us=gpu_us(f, iters))


def _best(*us):
    """The smallest of the timings that are not nan (a failed row's us), nan when all are: ``min`` alone
    returns nan or not depending on which argument is nan (``min(nan, x)`` is nan, ``min(x, nan)`` is x)."""
    ok = [u for u in us if not math.isnan(u)]
    return min(ok) if ok else float("nan")


def table(rows):
    """Markdown: one line per (d_model, B, T) with ours and each peer, ratios = peer / ours."""
    def get(kind, model, dm, B, T):
        for r in rows:
            if (r["kind"], r["model"], r.get("d_model"), r["B"], r["T"]) == (kind, model, dm, B, T):
                return r
        return None
    lines = ["| d_model | B x T | mamba_rl f32 | mamba_rl bf16 | GRU-1L (f32 / bf16 ratio) | LSTM-1L | LSTM-3L | "
             "best / GRU-1L | kernels f32/bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    have = {(r["d_model"], r["B"], r["T"]) for r in rows if r["kind"] == "train"}
    keys = [k for k in ROWS if k in have] + sorted(have - set(ROWS))
    for dm, B, T in keys:
        f, b = get("train", "mamba_rl_f32", dm, B, T), get("train", "mamba_rl_bf16", dm, B, T)
        fu = f["us"] if f else float("nan")
        bu = b["us"] if b else float("nan")
        cells = []
        for n in PEERS:
            p = get("train", n, dm, B, T)
            pu = p["us"] if p else float("nan")
            cells.append(f"{pu:.0f} ({pu / fu:.2f}x / {pu / bu:.2f}x)")
        gru = get("train", "gru1", dm, B, T)
        best = _best(fu, bu)
        ratio = gru["us"] / best if gru else float("nan")
        lines.append(f"| {dm} | {B} x {T} | {fu:.0f} | {bu:.0f} | " + " | ".join(cells) +
                     f" | {ratio:.2f}x | {f.get('kernels', '-') if f else '-'}/{b.get('kernels', '-') if b else '-'} |")
    if any(r["model"] == "mamba_rl_tf32" for r in rows):
        lines += ["", "| d_model | B x T | mamba_rl f32 | mamba_rl tf32 (opt-in) | mamba_rl bf16 | f32 / tf32 | GRU-1L / tf32 |",
                  "|---|---|---|---|---|---|---|"]
        for dm, B, T in keys:
            f, t32, b, gru = (get("train", m, dm, B, T) for m in ("mamba_rl_f32", "mamba_rl_tf32", "mamba_rl_bf16", "gru1"))
            if t32 is None:
                continue
            fu, tu, bu = (x["us"] if x else float("nan") for x in (f, t32, b))
            gu = gru["us"] if gru else float("nan")
            lines.append(f"| {dm} | {B} x {T} | {fu:.0f} | {tu:.0f} | {bu:.0f} | {fu / tu:.2f}x | {gu / tu:.2f}x |")
    lines += ["", "| B | step replay µs | public stepper.step µs | GPU µs a step (GRU-1L) | GRU-1L | LSTM-1L | LSTM-3L |",
              "|---|---|---|---|---|---|---|"]
    for B in INFER_B:
        o = get("infer", "mamba_rl", DM, B, 1)
        if o is None:
            continue
        cells = []
        for n in PEERS:
            p = get("infer", n, DM, B, 1)
            cells.append("-" if p is None else f"{p['us']:.1f} ({p['us'] / o['us']:.2f}x)")
        g = get("infer", "gru1", DM, B, 1) or {}
        gpu = "-" if "gpu_us" not in o else f"{o['gpu_us']:.1f} ({g.get('gpu_us', float('nan')):.1f})"
        lines.append(f"| {B} | {o['us']:.1f} | {o.get('api_us', float('nan')):.1f} | {gpu} | " + " | ".join(cells) + " |")
    if any(r["model"].startswith("mamba3") for r in rows):
        lines += ["", "| d_model | B x T | Mamba-1 best | Mamba-3 f32 | Mamba-3 bf16 | GRU-1L | Mamba-3 best / GRU-1L | "
                  "kernels f32/bf16 |", "|---|---|---|---|---|---|---|---|"]
        nan = dict(us=float("nan"))
        for dm, B, T in keys:
            m1 = _best(*((get("train", f"mamba_rl_{d}", dm, B, T) or nan)["us"] for d in ("f32", "bf16")))
            f, b = (get("train", f"mamba3_{d}", dm, B, T) or nan for d in ("f32", "bf16"))
            gru = (get("train", "gru1", dm, B, T) or nan)["us"]
            lines.append(f"| {dm} | {B} x {T} | {m1:.0f} | {f['us']:.0f} | {b['us']:.0f} | {gru:.0f} | "
                         f"{gru / _best(f['us'], b['us']):.2f}x | {f.get('kernels', '-')}/{b.get('kernels', '-')} |")
        lines += ["", "| B | Mamba-3 step replay µs | public stepper.step µs | Mamba-1 replay µs | GRU-1L µs |",
                  "|---|---|---|---|---|"]
        for B in INFER_B:
            o, m1, gru = (get("infer", n, DM, B, 1) or nan for n in ("mamba3", "mamba_rl", "gru1"))
            lines.append(f"| {B} | {o['us']:.1f} | {o.get('api_us', float('nan')):.1f} | {m1['us']:.1f} | "
                         f"{gru['us']:.1f} |")
    return "\n".join(lines)


TIMED = ("us", "api_us", "eager_us", "raw_graph_us", "gpu_us", "host_api_us", "host_replay_us")


def merge_rounds(rounds: list) -> list:
    """One row per (kind, model, d_model, B, T) from ``rounds`` (lists of rows): each timed field (``TIMED``) the
    median of its finite values over the rounds (NaN where none is finite), every other field from the first round
    that has the row, and (where there is more than one round) the rounds' ``us`` in ``us_rounds`` and the failed
    rounds' errors in ``errs``."""
    key = lambda r: (r["kind"], r["model"], r.get("d_model"), r["B"], r["T"])  # noqa: E731
    order, seen = [], {}
    for rows in rounds:
        for r in rows:
            k = key(r)
            if k not in seen:
                seen[k] = []
                order.append(k)
            seen[k].append(r)
    out = []
    for k in order:
        rs = seen[k]
        m = dict(rs[0])
        for f in (f for f in TIMED if f in m):
            vals = [r[f] for r in rs if isinstance(r.get(f), (int, float)) and math.isfinite(r[f])]
            m[f] = statistics.median(vals) if vals else float("nan")
        if len(rounds) > 1:
            m["us_rounds"] = [r.get("us", float("nan")) for r in rs]
            errs = [r["err"] for r in rs if "err" in r]
            m.pop("err", None)
            if errs:  # a round that failed: kept beside the rounds that did not
                m["errs"] = errs
        out.append(m)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", choices=["train", "infer"], default=None)
    ap.add_argument("--rows", type=int, default=None, help="only the first N rows of the training table")
    ap.add_argument("--select", nargs="+", default=None, metavar="DMxBxT",
                    help="only these training rows, e.g. 128x16x2048 (d_model x B x T; with --rows: within the first N)")
    ap.add_argument("--no-step-kernels", action="store_true", help="skip the one-token kernel's R / cluster sweep")
    ap.add_argument("--variants", action="store_true", help="also time the small-GEMM kernels forced off / on")
    ap.add_argument("--no-mamba3", action="store_true", help="skip the Mamba-3 rows (layer='Mamba3')")
    ap.add_argument("--stream-ab", action="store_true",
                    help="also time each training row with the weight gradients in the chain (models *_chain)")
    ap.add_argument("--tc-ab", action="store_true",
                    help="also time bf16 rows with the grouped weight-gradient kernel's tensor cores off")
    ap.add_argument("--dtypes", nargs="+", default=["f32", "tf32", "bf16"], choices=["f32", "tf32", "bf16"],
                    help="trainer dtypes of the Mamba-1 training rows (tf32: the opt-in TF32 GEMMs; Mamba-3: f32 / bf16)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every row this many times in turn and report the median (default 1)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds: expected an integer >= 1, got {a.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("bench: needs a GPU")
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    iters = 30 if a.quick else 100

    def record(rows, fn, fallback):
        try:
            r = fn()
        except Exception as e:  # record and keep going; the traceback goes to stderr
            traceback.print_exc()
            r = dict(fallback, us=float("nan"), err=repr(e)[:300])
        rows.extend(r if isinstance(r, list) else [r])
        for x in (r if isinstance(r, list) else [r]):
            print({k: v for k, v in x.items() if k not in ("profile", "kernel_seq")}, flush=True)
            for pr in x.get("profile", []):
                print(f"    {pr[2]:9.1f} us  x{pr[1]:<3d} {pr[0]}", flush=True)
            if x.get("kernel_seq"):
                print("    seq: " + " | ".join(k[:28] for k in x["kernel_seq"]), flush=True)

    train_rows = ROWS[:a.rows] if a.only != "infer" else []
    if a.select:
        try:
            wanted = {tuple(int(v) for v in r.lower().split("x")) for r in a.select}
        except ValueError:
            ap.error(f"--select: expected rows like 128x16x2048, got {a.select}")
        unknown = wanted - set(ROWS)
        if unknown:
            ap.error(f"--select: {sorted(unknown)} not among the training rows {ROWS}")
        train_rows = [r for r in train_rows if r in wanted]

    def run_round(first: bool) -> list:
        """Every selected row once (ours and the peers); profiles and the kernel sweep where ``first``."""
        rows = []
        for dm, B, T in train_rows:
            it = iters if B * T <= 16384 else max(20, iters // 3)
            for dt in a.dtypes:
                prof = first and dt != "tf32" and (dm, B, T) in PROFILED
                record(rows, lambda: bench_train(dm, B, T, dt, it, profile_it=prof),
                       dict(kind="train", model=f"mamba_rl_{dt}", d_model=dm, B=B, T=T, graph=True))
                for v in (("_torchgemm", "_xdtonly", "_gemmon") if a.variants and dt != "tf32" else ()):
                    record(rows, lambda: bench_train(dm, B, T, dt, it, variant=v),
                           dict(kind="train", model=f"mamba_rl_{dt}{v}", d_model=dm, B=B, T=T, graph=True))
                if a.stream_ab:
                    chain_prof = first and dt != "tf32" and (dm, B, T) == (128, 64, 128)
                    record(rows, lambda: bench_train(dm, B, T, dt, it, wgrad_stream="off", profile_it=chain_prof),
                           dict(kind="train", model=f"mamba_rl_{dt}_chain", d_model=dm, B=B, T=T, graph=True))
                if a.tc_ab and dt == "bf16":
                    record(rows, lambda: bench_train(dm, B, T, dt, it, tensor_cores=False,
                                                     profile_it=first and (dm, B, T) in PROFILED),
                           dict(kind="train", model=f"mamba_rl_{dt}_notc", d_model=dm, B=B, T=T, graph=True))
                if not a.no_mamba3 and dt != "tf32":
                    record(rows, lambda: bench_train(dm, B, T, dt, it, layer="Mamba3"),
                           dict(kind="train", model=f"mamba3_{dt}", d_model=dm, B=B, T=T, graph=True))
            if not a.no_peers:
                for n in PEERS:
                    record(rows, lambda: bench_peer_train(n, dm, B, T, it),
                           dict(kind="train", model=n, d_model=dm, B=B, T=T, graph=True))
        for B in (INFER_B if a.only != "train" else []):
            record(rows, lambda: bench_infer(B, 200 if not a.quick else 50, first and not a.no_step_kernels),
                   dict(kind="infer", model="mamba_rl", d_model=DM, B=B, T=1, graph=True))
            if not a.no_mamba3:
                record(rows, lambda: bench_infer(B, 200 if not a.quick else 50, False, layer="Mamba3"),
                       dict(kind="infer", model="mamba3", d_model=DM, B=B, T=1, graph=True))
            if not a.no_peers:
                for n in PEERS:
                    record(rows, lambda: bench_peer_infer(n, B, 200 if not a.quick else 50),
                           dict(kind="infer", model=n, d_model=DM, B=B, T=1, graph=True))
        return rows

    rounds = []
    for n in range(a.rounds):
        if a.rounds > 1:
            print(f"== round {n + 1} of {a.rounds}", flush=True)
        rounds.append(run_round(n == 0))
    rows = merge_rounds(rounds)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               tf32=False, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               rounds=a.rounds, rows=rows)
    json.dump(res, open(out, "w"), indent=1)
    print("\n" + table(rows), flush=True)


if __name__ == "__main__":
    main()
