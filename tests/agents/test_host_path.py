"""The CPU host path of the agent is bit-identical to the torch code it replaced (issue 21, host side):

- FlatHeadAdam's host step equals torch.optim.Adam's CPU step bit for bit (any head shapes, a changing lr,
  a clip factor), and its checkpoint format is torch.optim.Adam's;
"""

from __future__ import annotations

import pytest
import torch

from mamba_rl.agents.head_optim import FlatHeadAdam


@pytest.mark.parametrize("shapes", [[(2, 128), (2,), (1, 128), (1,)], [(7, 33), (7,), (1, 33), (1,)],
                                    [(5, 17), (5,), (1, 17), (1,), (5,)]])
def test_flat_head_adam_host_step_is_torch_adam_bit_for_bit(shapes):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    qs = [torch.nn.Parameter(t.clone()) for t in init]
    flat = FlatHeadAdam(ps, lr=1e-3, eps=1e-5)
    ref = torch.optim.Adam(qs, lr=1e-3, eps=1e-5)
    for it in range(60):
        grads = [torch.randn(s, generator=g) * 10.0 ** float(torch.randint(-6, 2, (), generator=g)) for s in shapes]
        clip = torch.rand((), generator=g) if it % 2 else None
        lr = 1e-3 * (1 - it / 60)
        flat.set_lr(lr)
        for grp in ref.param_groups:
            grp["lr"] = lr
        for q, gr in zip(qs, grads):
            q.grad = gr * clip if clip is not None else gr
        ref.step()
        if it % 3 == 0:  # the torch-style entry point (p.grad) takes the same path
            for p, gr in zip(ps, grads):
                p.grad = gr * clip if clip is not None else gr
            flat.step()
        else:
            flat.host_step(flat.flat_grad(grads), clip)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    sd, rd = flat.state_dict(), ref.state_dict()
    assert sd["param_groups"][0].keys() == rd["param_groups"][0].keys()
    for i in range(len(shapes)):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(sd["state"][i][k]), torch.as_tensor(rd["state"][i][k])), (i, k)


def test_flat_head_adam_host_step_checks_its_gradient():
    flat = FlatHeadAdam([torch.nn.Parameter(torch.zeros(3, 4))], lr=1e-3)
    with pytest.raises(ValueError, match=r"grad must be float32 \[12\], got torch.float32 \[11\]"):
        flat.host_step(torch.zeros(11))
    with pytest.raises(ValueError, match="got torch.float64"):
        flat.host_step(torch.zeros(12, dtype=torch.float64))
