"""Rank functions for tests/ranks/test_compile.py (no tests here): a split model compiled against eager."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import parallel
from parallel.grid import Grid
from parallel.model.compiled import compile_model


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Conv3d(4, 4, 3, padding=1), nn.LeakyReLU(0.3),
                         nn.Flatten(), nn.Linear(4 * 4 * 4 * 4, 3))


def _run(pmodel: nn.Module, xb: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    pmodel.zero_grad(set_to_none=True)
    out = pmodel(xb)
    (out.square().sum() + out.sum()).backward()
    return out.detach(), [p.grad.clone() for p in pmodel.parameters()]


def compiled_equals_eager(grid: Grid, backend: str) -> dict[str, Any]:
    """Forward and gradients of the split model compiled with ``backend`` against eager
    (float32, two calls: the compiled code runs, not only the tracing), and what the graphs
    handed to ``backend`` held: graphs of the computation, none holding an exchange (the
    graphs are noted on their way to ``backend``, so one compilation serves both checks)."""
    torch.manual_seed(0)
    serial = _net()
    captured: list[torch.fx.GraphModule] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        captured.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    eager = parallel.parallelize(copy.deepcopy(serial), grid, input_shape=(2, 8, 8, 8))
    compiled = parallel.parallelize(copy.deepcopy(serial), grid, input_shape=(2, 8, 8, 8))
    compile_model(compiled, counting)  # what train.compile runs, the graphs noted on the way
    recomputed = parallel.parallelize(copy.deepcopy(serial), grid, input_shape=(2, 8, 8, 8), recompute=True)
    compile_model(recomputed, backend)  # train.activation_checkpointing: blocks under torch.utils.checkpoint
    for seed in (1, 2):
        torch.manual_seed(seed)
        xb = parallel.scatter(torch.randn(2, 2, 8, 8, 8), grid)
        out_e, grads_e = _run(eager, xb)
        for model in (compiled, recomputed):
            out_c, grads_c = _run(model, xb)
            # float32; a compiler may fuse and reorder the pointwise work: relative 1e-5
            torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
            for g_c, g_e in zip(grads_c, grads_e):
                torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6)
        if seed == 1:
            graphs = list(captured)  # what the first call compiled
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {"graphs": len(graphs), "convolutions": sum("conv" in t for t in targets),
            "messages": [t for t in targets if any(w in t for w in ("send", "recv", "P2POp"))],
            "collectives": sorted({t for t in targets if "c10d" in t or "distributed" in t})}
