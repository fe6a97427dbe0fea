"""Memory per rank of a Flatten+Linear's hierarchical A: its diagonal blocks against spatial ranks.

    python scripts/kfac_blocks.py --channels 512 --volume 4 --out 128 --flat-blocks 2 2 2 \
        --grids 1,1,1 2,1,1 2,2,1

Flatten + Linear(C x V^3, out) on a C x V^3 input (the defaults are CosmoFlow's head at
128^3: 512 x 4^3 -> 128, A 32,769 wide), split at each grid (one rank per block, gloo on
the CPU), K-FAC with ``flat_blocks`` (factors and inverses every step) takes one step on
random features. Printed per grid (every rank alike, the largest shown): the diagonal
blocks a rank holds, the bytes of the optimiser's tensors that hold them (the running
Grams' triangles, eigenvectors and eigenvalues, counted from the tensors themselves), the
summary's ``block_memory_bytes`` (which also counts the step's sums and the all-reduce
buffer), whether the weight is sharded, the step's time and the rank's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import parallel  # noqa: E402
from parallel.bench.ranks import run_ranks  # noqa: E402
from parallel.kfac import KFAC, KFACConfig  # noqa: E402


def measure(grid: Any, channels: int, volume: int, out: int, flat_blocks: list[int], rows: int, max_dim: int
            ) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(channels * volume**3, out))
    pmodel = parallel.parallelize(model, grid) if grid.spatial_size > 1 else model
    opt = KFAC(pmodel, grid, KFACConfig(flat_blocks=flat_blocks, factor_interval=1, inverse_interval=1,
                                           max_factor_dim=max_dim),
               lr=1e-3, momentum=0.9)
    x = torch.randn(rows, channels, volume, volume, volume, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    opt.zero_grad()
    y = pmodel(parallel.scatter(x, grid) if grid.spatial_size > 1 else x)
    (y**2).mean().backward()
    opt.step()
    seconds = time.perf_counter() - start
    layer = opt.layers[0]
    a = opt.factors[layer.key][0]
    sketch = layer.dim_a * (layer.omega.shape[1] + 1)  # type: ignore[union-attr]
    form = opt.eigen[layer.key][0]
    held = (a.numel() - sketch) * a.element_size() + sum(t.numel() * t.element_size() for t in [*form.q, *form.e])
    entry = opt.report()["low_rank"][layer.name]
    return {"spatial": "x".join(map(str, grid.spatial)), "ranks": grid.world_size, "width": layer.dim_a,
            "blocks": entry["blocks"], "blocks_held": entry["blocks_held"], "held_mb": held / 1e6,
            "block_memory_mb": entry["block_memory_bytes"] / 1e6, "local": entry["blocks_local"],
            "sharded": bool(getattr(layer.weight, "spatial_shard", False)), "step_s": seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--channels", type=int, default=512)
    p.add_argument("--volume", type=int, default=4, help="the flattened volume's edge (voxels)")
    p.add_argument("--out", type=int, default=128)
    p.add_argument("--flat-blocks", type=int, nargs=3, default=[2, 2, 2])
    p.add_argument("--grids", nargs="+", default=["1,1,1", "2,1,1", "2,2,1"], help="spatial splits D,H,W")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--max-factor-dim", type=int, default=4096, help="kfac.max_factor_dim (below the width)")
    p.add_argument("--jsonl", type=Path, help="append the rows here")
    args = p.parse_args(argv)
    print("| spatial | ranks | width | blocks | held per rank | held bytes per rank (MB) | block_memory_bytes (MB) "
          "| local | sharded | step (s) | peak RSS per rank (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for g in args.grids:
        spatial = [int(v) for v in g.split(",")]
        world = spatial[0] * spatial[1] * spatial[2]
        res = run_ranks(world, measure, args.channels, args.volume, args.out, list(args.flat_blocks), args.rows,
                        args.max_factor_dim, spatial=spatial, timeout=3600)
        r = max(res, key=lambda x: x["held_mb"])
        r["step_s"] = max(x["step_s"] for x in res)
        r["peak_rss_mb"] = max(x["peak_rss_mb"] for x in res)
        print(f"| {r['spatial']} | {r['ranks']} | {r['width']} | {r['blocks']} | {r['blocks_held']} | "
              f"{r['held_mb']:.1f} | {r['block_memory_mb']:.1f} | {r['local']} | {r['sharded']} | "
              f"{r['step_s']:.1f} | {r['peak_rss_mb']:.0f} |", flush=True)
        if args.jsonl:
            with args.jsonl.open("a") as f:
                f.write(json.dumps({**r, "flat_blocks": list(args.flat_blocks)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
