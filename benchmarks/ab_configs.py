"""A/B of training-step configurations in one process (benchmarks/NOTES.md: calls land on different machines of
one kind whose times differ by 10-15 %, so a change of a few µs needs both sides timed in one process).

Each round times every (row, dtype, configuration) once with ``bench.bench_train`` (graph replay, median µs of
``--iters`` calls, kernels per replay); the rounds alternate the configurations, so a drift of the machine shows
as a difference between rounds, not between configurations. Configurations (``CONFIGS``): ``base`` (the
defaults), ``optsplit`` (grad_stats and AdamW as two launches: ``mamba_rl.ops.optim.FUSED = False``),
``stream_on`` / ``chain`` (the weight gradients on their second stream at every size / never:
``fused.WGRAD_STREAM``), ``wgrad_on`` (the grouped weight-gradient kernel at every size: ``fused.WGRAD = "on"``),
``wgrad_on_s<K>`` (the same with a forced K slice of K rows: ``fused.WGRAD_SLICE``), ``notc`` (its bf16 jobs on the
FFMA path), ``bwd3`` / ``bwd4`` (the scan backward's 3- / 4-block build forced: ``ext.scan_set_bwd_blocks``),
``nocoop`` (each scan direction and the conv backward as separate launches instead of one cooperative launch:
``ext.set_coop(0)``), ``coop_sf`` / ``coop_sb`` / ``coop_cb`` (only the scan forward /
scan backward / conv backward as one cooperative launch), ``fewer_off`` (the conv inside the x_proj kernel, the
input projection inside the first norm, the float32 out_proj through cuBLASLt and the final state written into
the carried state, the final norm's forward and backward as one kernel, all off: ``fused.CONV_XDT`` etc.),
``no_conv_xdt`` / ``no_input_norm`` / ``no_lt`` / ``no_final_direct`` / ``no_norm_f_fused`` (one of them off),
``conv_dw_conv`` / ``norm_dw_norm`` / ``dw_own`` (the conv's / the norms' / both weight-gradient sums in their own
kernels, not in the grouped launch: ``fused.CONV_DW``, ``fused.NORM_DW``).

Usage (device): python3 benchmarks/ab_configs.py --rows 128x16x64 128x64x128 --dtypes f32 bf16
    --configs base optsplit --rounds 2 --out $OUT/ab.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (benchmarks/bench.py: the timing method and the trainer rows)

CONFIGS = {
    "base": {},
    "optsplit": dict(optim_fused=False),
    "stream_on": dict(wgrad_stream="on"),
    "chain": dict(wgrad_stream="off"),
    "wgrad_on": dict(variant="_wgradon"),
    # the grouped kernel at every size with a forced K slice (fused.WGRAD_SLICE): fewer, longer items
    **{f"wgrad_on_s{k}": dict(variant="_wgradon", fused_flags=dict(WGRAD_SLICE=k), tag=f"_s{k}")
       for k in (128, 256, 512, 1024, 2048, 4096, 8192, 65536)},
    "notc": dict(tensor_cores=False),
    "nocoop": dict(coop=0),
    "bwd3": dict(bwd_blocks=3),  # the scan backward's 3-block build forced (ext.scan_set_bwd_blocks)
    "bwd4": dict(bwd_blocks=4),
    "coop_sf": dict(coop=1),
    "coop_sb": dict(coop=2),
    "coop_cb": dict(coop=4),
    # the sixteenth session's launch cuts off, all four (the version before) and one at a time
    "fewer_off": dict(fused_flags=dict(CONV_XDT="off", INPUT_NORM="off", OUT_PROJ_LT=False, FINAL_DIRECT="off",
                                       NORM_F_FUSED="off"), tag="_fewer_off"),
    "no_conv_xdt": dict(fused_flags=dict(CONV_XDT="off"), tag="_no_conv_xdt"),
    "no_input_norm": dict(fused_flags=dict(INPUT_NORM="off"), tag="_no_input_norm"),
    "no_lt": dict(fused_flags=dict(OUT_PROJ_LT=False), tag="_no_lt"),
    "no_final_direct": dict(fused_flags=dict(FINAL_DIRECT="off"), tag="_no_final_direct"),
    "no_norm_f_fused": dict(fused_flags=dict(NORM_F_FUSED="off"), tag="_no_norm_f_fused"),
    # the conv's weight-gradient column sums in its own cooperative launch, not in the grouped launch
    "conv_dw_conv": dict(fused_flags=dict(CONV_DW="conv"), tag="_conv_dw_conv"),
    # the norms' dw sums in their own kernels (the last block), not in the grouped launch; and both
    "norm_dw_norm": dict(fused_flags=dict(NORM_DW="norm"), tag="_norm_dw_norm"),
    "dw_own": dict(fused_flags=dict(CONV_DW="conv", NORM_DW="norm"), tag="_dw_own"),
}


def parse_row(s: str):
    try:
        dm, B, T = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a row like 128x16x64 (d_model x B x T), got {s!r}") from None
    return dm, B, T


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", type=parse_row, default=[(128, 16, 64)], metavar="DMxBxT")
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=["f32", "tf32", "bf16"])
    ap.add_argument("--configs", nargs="+", default=["base", "optsplit"], choices=sorted(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ab_configs: needs a GPU")
    rows = []
    for rnd in range(a.rounds):
        for dm, B, T in a.rows:
            it = a.iters if B * T <= 16384 else max(20, a.iters // 3)
            for dt in a.dtypes:
                for name in a.configs:
                    try:
                        r = bench.bench_train(dm, B, T, dt, it, **CONFIGS[name])
                    except Exception as e:  # record and keep going
                        traceback.print_exc()
                        r = dict(kind="train", d_model=dm, B=B, T=T, us=float("nan"), err=repr(e)[:300])
                    r.update(config=name, round=rnd, dtype=dt)
                    rows.append(r)
                    print(f"round {rnd} {dm}x{B}x{T} {dt:5s} {name:10s} {r['us']:9.1f} us  "
                          f"kernels {r.get('kernels')}", flush=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
