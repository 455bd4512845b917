"""benchmarks/learning/popgym.py's ``--set aux_add=C`` harness patch: A = A_main + C * A_aux at valid steps."""
import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _harness():
    spec = importlib.util.spec_from_file_location("popgym_harness", os.path.join(ROOT, "benchmarks", "learning", "popgym.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_aux_add_is_additive_in_reward_units():
    from mamba_rl.agents import update as U

    saved = U.combine_advantages
    try:
        _harness()._aux_additive(3.0)
        a = torch.tensor([[1.0, -2.0, 0.5]])
        b = torch.tensor([[1e-4, 2e-4, -1e-4]])  # a near-constant reward's aux advantage stays that small
        valid = torch.tensor([[True, True, False]])
        out = U.combine_advantages(a, b, valid, 0.3)
        torch.testing.assert_close(out, torch.tensor([[1.0003, -1.9994, 0.0]]))
    finally:
        U.combine_advantages = saved
