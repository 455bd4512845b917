"""The one-token step's replay two ways in one process: GraphSet's C++ launcher (cudaGraphLaunch from the
extension, the Python side checking only the buffers' identity) against torch's CUDAGraph.replay behind the
Python pointer guard (the path before). Alternating rounds, bench.py's method (events around every call; and
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
        res = {"cpp": [], "torch": [], "cpp_host": [], "torch_host": [], "bare_torch": []}
        for r in range(a.rounds):
            order = ("cpp", "torch") if r % 2 == 0 else ("torch", "cpp")
            for way in order:
                st._graphs._launch = launchers if way == "cpp" else {}
                res[way].append(timeit(lambda: st.step(None), a.iters))
                res[way + "_host"].append(host_us(lambda: st.step(None), a.iters))
            res["bare_torch"].append(timeit(st._graphs["step"].replay, a.iters))
        st._graphs._launch = launchers
        row = {"B": B, **{k: round(statistics.median(v), 2) for k, v in res.items()},
               "rounds": {k: [round(x, 2) for x in v] for k, v in res.items()}}
        print(f"B={B}: step(None) C++ launch {row['cpp']} µs (host {row['cpp_host']}), torch replay + guard "
              f"{row['torch']} (host {row['torch_host']}), bare torch replay {row['bare_torch']}", flush=True)
        rows.append(row)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
