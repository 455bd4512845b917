"""The one-token step's replay three ways in one process: GraphSet's C++ launcher (cudaGraphLaunch from the
extension, the Python side checking only the buffers' identity), torch's CUDAGraph.replay behind the Python
pointer guard, and that under torch.no_grad() as a decorator (Stepper.step before the thirty-first session).
Alternating rounds, bench.py's method (events around every call; and
host µs per call after a synchronize), median per round, then the median over rounds.

Usage (device): python3 benchmarks/probes/graph_launch_ab.py [--rounds 5] [--iters 300] [--out FILE.json]
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench import host_us, timeit  # noqa: E402

from mamba_rl import MambaBackbone, MambaConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for B in a.batches:
        net = MambaBackbone(MambaConfig(d_model=128, n_layers=3), 32, device="cuda", seed=0, backend="cuda")
        st = net.stepper(batch=B)
        st.capture_graph()
        st.x_buf.copy_(torch.randn(B, 32, device="cuda"))
        launchers = dict(st._graphs._launch)
        assert launchers, "no C++ launcher bound (torch without raw_cuda_graph_exec, or an old extension)"
        ways = {"cpp": lambda: st.step(None), "torch": lambda: st.step(None),
                "before": torch.no_grad()(lambda: st.step(None))}
        res = {k: [] for w in ways for k in (w, w + "_host")}
        res["bare_torch"] = []
        for r in range(a.rounds):
            for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                st._graphs._launch = launchers if way == "cpp" else {}
                res[way].append(timeit(ways[way], a.iters))
                res[way + "_host"].append(host_us(ways[way], a.iters))
            res["bare_torch"].append(timeit(st._graphs["step"].replay, a.iters))
        st._graphs._launch = launchers
        row = {"B": B, **{k: round(statistics.median(v), 2) for k, v in res.items()},
               "rounds": {k: [round(x, 2) for x in v] for k, v in res.items()}}
        print(f"B={B}: step(None) C++ launch {row['cpp']} µs (host {row['cpp_host']}), torch replay + guard "
              f"{row['torch']} (host {row['torch_host']}), that under no_grad (before) {row['before']} (host "
              f"{row['before_host']}), bare torch replay {row['bare_torch']}", flush=True)
        rows.append(row)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
