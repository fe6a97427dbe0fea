"""The summary's peak memory: reset after the start-up checks, reserved beside allocated.

The peak used to be ``max_memory_allocated`` from the start of the process: it counted
``parallel.verify``'s float64 copies of the model, and left out what the caching
allocator reserves. On the CPU the same functions read and reset ``VmHWM``, so the reset
is checked here for real; the CUDA branch calls torch's peak statistics
(``scripts/gpu_check.sh`` shows both figures from its trainings' summaries).
"""

from __future__ import annotations

import torch

from parallel.runtime import memory
from parallel.train.observe import summary


def test_the_peak_is_reset_to_what_is_held_now():
    cpu = torch.device("cpu")
    assert memory.reset_peak(cpu)  # from what is held now, whatever earlier tests peaked at
    before = memory.peak_memory_bytes(cpu)
    big = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB, touched
    peak = memory.peak_memory_bytes(cpu)
    assert peak >= before + 200 * 2**20
    del big
    assert memory.reset_peak(cpu)
    after = memory.peak_memory_bytes(cpu)
    assert after < peak - 200 * 2**20, (peak, after)


def test_the_summary_reports_reserved_beside_allocated():
    # per-rank rows as the loop gathers them: allocated peak, bytes read, wait, samples, reserved peak
    rows = torch.tensor([[100.0 * 2**20, 10, 0.5, 2, 150.0 * 2**20], [90.0 * 2**20, 10, 0.5, 2, 120.0 * 2**20]],
                        dtype=torch.float64)
    assert summary.PER_RANK[4] == "peak_reserved_bytes"

    class Grid:
        world_size, data_size, spatial = 2, 1, (2, 1, 1)

    s = summary.summarize(Grid(), {"status": "completed", "steps": 2, "epochs": 1.0, "metric": "val_mae",
                                  "best_metric": 0.1, "target": 0.2, "samples_per_s": 1.0, "run_seconds": 1.0},
                         rows, 4)
    assert s["peak_memory_bytes_per_rank"] == [100 * 2**20, 90 * 2**20]
    assert s["peak_reserved_bytes_per_rank"] == [150 * 2**20, 120 * 2**20]
    assert "peak memory per rank (MiB): 100, 90 allocated; 150, 120 reserved" in summary.format_summary(s)
    assert memory.peak_reserved_bytes(torch.device("cpu")) == memory.peak_memory_bytes(torch.device("cpu"))
