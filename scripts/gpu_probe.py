"""Step time and peak memory of one CosmoFlow training step per rank (for scripts/gpu_check.py).

Runs under any launcher; rank 0 prints one line ``PROBE {json}`` per rank: the median step time
(the device synchronised around each step), and on a GPU the peak allocated and reserved
memory and the device memory in use at the end (``total - free`` from ``mem_get_info``:
reserved memory plus the CUDA context and NCCL's buffers, which ``max_memory_allocated``
leaves out); on a CPU the process's peak resident memory::

    python scripts/gpu_probe.py --size 128
    torchrun --nproc-per-node 4 scripts/gpu_probe.py --size 128 --spatial 2 2 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

import parallel
from parallel import comm
from cosmoflow.model import CosmoFlow, CosmoFlowConfig


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=128, help="volume edge (default 128)")
    ap.add_argument("--spatial", type=int, nargs=3, default=[1, 1, 1], metavar=("SD", "SH", "SW"))
    ap.add_argument("--batch", type=int, default=0, help="global batch (default: one sample per data group)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    args = ap.parse_args(argv)
    grid = parallel.init(spatial=args.spatial, timeout_s=300)
    device = grid.device
    torch.manual_seed(0)
    blocks = max(1, min(5, args.size.bit_length() - 3))
    model = CosmoFlow(CosmoFlowConfig(n_conv_blocks=blocks, dropout=0.0), args.size)
    pmodel = parallel.parallelize(model, grid)
    opt = torch.optim.SGD(pmodel.parameters(), lr=1e-3, momentum=0.9)
    batch = args.batch or grid.data_size
    x = parallel.scatter(torch.randn(batch, 4, args.size, args.size, args.size), grid)
    y = torch.randn(batch, 4, device=device)[slice(*grid.batch_range(batch))]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(args.steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = (pmodel(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if step:
            times.append(time.perf_counter() - t0)
    row = {"rank": grid.rank, "world": grid.world_size, "spatial": list(grid.spatial), "size": args.size,
           "precision": args.precision, "device": str(device), "step_seconds": statistics.median(times)}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        row.update(allocated_bytes=torch.cuda.max_memory_allocated(device),
                   reserved_bytes=torch.cuda.max_memory_reserved(device),
                   device_used_bytes=total - free, device_total_bytes=total)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        row.update(allocated_bytes=peak, reserved_bytes=peak, device_used_bytes=peak)
    # Rank 0 prints every rank's line: lines written by several processes at once interleave.
    rows = comm.all_gather_bytes(json.dumps(row).encode(), grid.cpu_group)
    if grid.rank == 0:
        for line in rows:
            print("PROBE " + line.decode(), flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
