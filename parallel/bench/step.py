"""Training-step time and peak memory of the models for a grid, on synthetic batches."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

import parallel
from parallel.bench import device as dev
from parallel.runtime import memory
from parallel.bench.timing import interleaved, median, ratio
from parallel.grid import Grid
from parallel.plan import build_model
from parallel.job.family import get


def make_model(name: str, size: Sequence[int], overrides: Sequence[str]) -> tuple[nn.Module, tuple[int, ...]]:
    """A real (CPU) model built from the same config ``parallel.plan`` traces."""
    _, in_shape, _ = build_model(name, size, overrides)  # validates the overrides
    torch.manual_seed(0)
    return build_model(name, size, overrides, device="cpu")[0], in_shape


class Stepper:
    """One model on one grid: ``step()`` runs forward, loss, backward and an SGD update."""

    def __init__(self, grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
                 overlap: bool | str = False, recompute: bool = False, active: bool = True,
                 channels_last: bool = False, conv_path: str = "shell", noise_scale: bool = False) -> None:
        self.active = active
        self.noise_scale = False
        if not active:
            return
        model, in_shape = make_model(name, size, overrides)
        self.device = grid.device
        # Flatten+Linear weights sharded by block, as the training loop runs them.
        self.pmodel = parallel.parallelize(model, grid, overlap_halo=overlap, recompute=recompute,
                                           input_shape=in_shape, channels_last=channels_last,
                                           conv_path=conv_path)
        if noise_scale:  # the hierarchical sync forming each data group's gradient (parallel.model.gradsync)
            self.noise_scale = self.pmodel.measure_noise_scale(True)
        self.opt = torch.optim.SGD(self.pmodel.parameters(), lr=1e-4, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn((batch, *in_shape), generator=gen)
        x = parallel.scatter(x, grid).clone() if grid.world_size > 1 else x  # the block only, as a reader gives
        self.x = x.to(grid.device)

    def step(self) -> None:
        if not self.active:
            return
        out = self.pmodel(self.x)
        out.float().square().mean().backward()
        if self.noise_scale:  # the data groups' squared norms summed over every rank, as the training step does
            self.pmodel.sync.small_norm_sq()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dev.sync(self.device)  # the timers see the device's work (CUDA)


def step_grids(grid: Grid) -> tuple[Grid, Grid]:
    """The serial grid (this rank alone) and the data-parallel grid (every rank, no split)
    of the step benchmark, both on ``grid``'s device: on GPUs ``parallelize`` broadcasts
    the parameters over NCCL, which takes only tensors on the rank's GPU."""
    serial = Grid(spatial=(1, 1, 1), world_size=1, rank=0, device=grid.device)
    data = Grid.from_world((1, 1, 1), device=grid.device)
    return serial, data


def step_times(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
               trials: int, weak_size: Sequence[int] | None, overlap: bool | str) -> dict[str, Any]:
    """On a 2-rank world: serial (rank 0 alone, one thread), spatial 2, data 2, (weak
    scaling) spatial 2 on a volume twice as deep, and the floor of spatial 2 (both ranks
    running the plain model on a block-sized volume, no communication), in interleaved
    trials."""
    world = grid.world_group
    serial_grid, data_grid = step_grids(grid)
    steppers = {
        "serial": Stepper(serial_grid, name, size, overrides, batch, active=grid.rank == 0),
        "spatial2": Stepper(grid, name, size, overrides, batch, overlap=overlap),
    }
    if batch % 2 == 0:
        steppers["data2"] = Stepper(data_grid, name, size, overrides, batch)
        # the same with the gradient noise scale measured (train.noise_scale): interleaved beside it
        steppers["data2_noise"] = Stepper(data_grid, name, size, overrides, batch, noise_scale=True)
    if weak_size is not None:
        steppers["spatial2_weak"] = Stepper(grid, name, weak_size, overrides, batch, overlap=overlap)
    # The floor of spatial 2 on this machine: each rank runs the plain model on a volume the
    # size of its block, both at once, with no communication at all (what the split step
    # would take if halos, corrections and the gradient all-reduce cost nothing).
    block = [n // s for n, s in zip(size, grid.spatial)]
    steppers["floor2"] = Stepper(serial_grid, name, block, overrides, batch)
    times = interleaved({k: s.step for k, s in steppers.items()}, trials, warmup=1, group=world, device=grid.device)
    out: dict[str, Any] = {"seconds": {k: median(v) for k, v in times.items()},
                           "best_seconds": {k: min(v) for k, v in times.items()}}
    out["strong_ratio_spatial2"] = ratio(times["spatial2"], times["serial"])
    if "data2" in times:
        out["strong_ratio_data2"] = ratio(times["data2"], times["serial"])
        out["noise_over_flat_data2"] = ratio(times["data2_noise"], times["data2"])
    if "spatial2_weak" in times:
        out["weak_efficiency_spatial2"] = 1.0 / ratio(times["spatial2_weak"], times["serial"])
    out["floor_ratio_spatial2"] = ratio(times["floor2"], times["serial"])
    return out


def sync_times(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
               trials: int) -> dict[str, Any]:
    """On data x spatial ranks (``grid``, both axes > 1): the step with one all-reduce over
    every rank (the gradient noise scale off) and with the hierarchical sync measuring it
    (reduce-scatter, shard all-reduce, all-gather, and the one-scalar sum), in interleaved
    trials; each trial the slowest rank's."""
    steppers = {"flat": Stepper(grid, name, size, overrides, batch),
                "hierarchical": Stepper(grid, name, size, overrides, batch, noise_scale=True)}
    if not steppers["hierarchical"].pmodel.sync.hierarchical:
        raise RuntimeError(f"sync_times: no hierarchical bucket at data {grid.data_size} x spatial {grid.spatial}")
    # each side's run-to-run spread: the same flat step twice, interleaved with the others
    steppers["flat_again"] = Stepper(grid, name, size, overrides, batch)
    times = interleaved({k: s.step for k, s in steppers.items()}, trials, warmup=1, group=grid.world_group,
                        device=grid.device)
    return {"seconds": {k: median(v) for k, v in times.items()},
            "hierarchical_over_flat": ratio(times["hierarchical"], times["flat"]),
            "flat_again_over_flat": ratio(times["flat_again"], times["flat"])}


def peak_memory(grid: Grid, name: str, size: Sequence[int], overrides: Sequence[str], batch: int,
                recompute: bool, overlap: bool | str = False, steps: int = 1) -> dict[str, float]:
    """Peak resident memory of this rank over ``steps`` steps, and its baseline before the model.

    The baseline is taken after a step of a tiny model of the same family, so that what
    the first step of anything costs once (torch's optimiser imports its compiler stack,
    ~70 MB of Python modules; gloo and oneDNN set up their buffers) counts as runtime,
    not as this model's memory.
    """
    import gc

    tiny = list(get(name).tiny_overrides)
    warm = Stepper(grid, name, [4 * g for g in grid.spatial], tiny, 1, overlap=overlap, recompute=recompute)
    warm.step()
    del warm
    gc.collect()
    if grid.device.type == "cuda":
        torch.cuda.empty_cache()  # the baseline: the context and what the runtime keeps, no cached blocks
    reset = memory.reset_peak(grid.device)
    baseline = memory.in_use_bytes(grid.device)
    s = Stepper(grid, name, size, overrides, batch, overlap=overlap, recompute=recompute)
    for _ in range(steps):
        s.step()
    # CPU: VmHWM, this process's own peak; CUDA: peak reserved + context (what the device held).
    peak = memory.peak_held_bytes(grid.device)
    return {"baseline_bytes": baseline, "peak_bytes": peak, "above_baseline": peak - baseline,
            "peak_reset": float(reset)}


def loader_share(grid: Grid, files: list[str], name: str, size: int, overrides: Sequence[str], batch: int,
                 workers: int, steps: int) -> dict[str, float]:
    """Seconds per step and seconds waiting for data, reading blocks from ``files``."""
    import time

    from parallel.data import BlockDataset, make_loader

    class Batches:
        start_step = 0

        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return steps

        def __iter__(self):  # type: ignore[no-untyped-def]
            for i in range(steps):
                yield [(i * batch + j) % self.n for j in range(batch)]

        def set_epoch(self, epoch: int, start: int = 0) -> None:
            pass

    geometry = Grid(spatial=grid.spatial, world_size=grid.world_size, rank=grid.rank)  # picklable for workers
    ds = BlockDataset(files, grid=geometry if grid.spatial_size > 1 else None)
    loader = make_loader(ds, Batches(len(ds)), num_workers=workers, prefetch_factor=2)
    s = Stepper(grid, name, (size,) * 3, overrides, batch)
    family = get(name)

    wait = total = 0.0
    t_start = time.perf_counter()
    n = 0
    for b, stats in loader:
        x = (family.transform(b) if family.transform is not None else b)[family.input_field].float()
        s.x = x
        s.step()
        if n > 0:  # the first batch includes starting the workers
            wait += stats.wait_seconds
        else:
            t_start = time.perf_counter()
        n += 1
    total = time.perf_counter() - t_start
    ds.close()
    return {"steps": n - 1, "seconds": total, "wait_seconds": wait, "wait_share": wait / max(total, 1e-9)}
