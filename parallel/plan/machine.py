"""What one rank and the network between ranks can do: the figures ``predict`` uses,
measured by ``python scripts/benchmark.py calibrate`` or given on the command line.

Without a calibration the figures are *generic*: ``Machine.generic("cpu")`` (this
project's 2-core development machine, rounded) or ``Machine.generic("gpu")`` (an
H100/H200-class GPU per rank with NVLink, guessed from public specifications; nothing in
it was measured). ``label`` says which, and the planner prints it."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


def default_calibration() -> Path:
    """``$SPATIALCNN_CALIBRATION``, else ``runs/calibration.json`` of the repository."""
    return Path(os.environ.get("SPATIALCNN_CALIBRATION",
                               Path(__file__).resolve().parents[2] / "runs" / "calibration.json"))


@dataclass
class Machine:
    """Measured (or given) figures of one rank and the network between ranks."""

    conv_flops: dict[str, Any] = field(default_factory=dict)
    """Conv forward+backward flop/s per shape key ``cin-cout-k`` (one rank): a number, or
    ``[[voxels, flop/s], ...]`` measured at several block sizes (interpolated in log voxels)."""
    default_conv_flops: float = 2.0e10
    """Conv flop/s for shapes not measured."""
    mem_bandwidth: float = 2.0e9
    """Bytes/s of element-wise and pooling layers (forward + backward traffic)."""
    p2p_alpha: float = 5.0e-5
    """Seconds per point-to-point message (latency)."""
    p2p_beta: float = 1.0e9
    """Point-to-point bytes/s."""
    ar_alpha: float = 1.0e-4
    """Seconds per all-reduce step."""
    ar_beta: float = 1.0e9
    """All-reduce bytes/s per link."""
    layer_overhead: float = 2.0e-4
    """Seconds of framework overhead per layer and step (Python, dispatch, bookkeeping)."""
    spatial_layer_overhead: float = 1.0e-3
    """Extra seconds per split layer and step (shape cache, plans, halo thread)."""
    io_bandwidth: float = 5.0e8
    """Bytes/s one rank reads from storage (and decodes)."""
    baseline_memory: float = 3.0e8
    """Bytes of a rank before the model: the runtime, torch, the process group."""
    layer_seconds: dict[str, float] = field(default_factory=dict)
    """Measured forward+backward seconds of one layer's local computation (no communication),
    keyed by ``op_key``: the layer, its block, the local batch and which dims are split.
    Where a layer's key is here it replaces the throughput estimate; elsewhere (other
    sizes, other machines) the per-shape throughputs extrapolate."""
    layer_seconds_busy: dict[str, float] = field(default_factory=dict)
    """The same, timed while ``busy_ranks`` processes computed at once on this machine (as
    the ranks of a job sharing a node's cores and memory bandwidth do)."""
    busy_ranks: int = 1
    """How many processes ran at once for ``layer_seconds_busy``."""
    busy_factor: float = 1.0
    """Median of busy over alone layer times: the slowdown of layers not timed busy."""
    overlap_overhead: float = 2.0e-4
    """Seconds an overlapped halo exchange costs beyond a blocking one (handing it to the
    halo thread, or a side stream's waits), forward or backward."""
    source: str = "generic-cpu"
    """Where the figures come from: ``generic-cpu``, ``generic-gpu``, or ``measured``."""
    device: str = "cpu"
    """The device the figures describe (``cpu`` or ``cuda``)."""
    measured_at: str = ""
    """When and where a calibration was measured (host, date, torch), for the label."""

    def flops(self, cin: int, cout: int, k: int, voxels: float | None = None,
              shape: Sequence[int] | None = None) -> float:
        """Measured throughput of this conv: at this block shape if measured (the library's
        kernels differ by shape, not only by size), else interpolated in the voxel count."""
        got = self.conv_flops.get(f"{cin}-{cout}-{k}", self.default_conv_flops)
        if isinstance(got, (int, float)):
            return float(got)
        if shape is not None:
            for pt in got:
                if len(pt) > 2 and list(pt[2]) == list(shape):
                    return float(pt[1])
        pts = sorted((float(p[0]), float(p[1])) for p in got)
        if voxels is None or len(pts) == 1 or voxels <= pts[0][0]:
            return pts[0][1] if voxels is not None and voxels <= pts[0][0] else pts[-1][1]
        if voxels >= pts[-1][0]:
            return pts[-1][1]
        for (v0, f0), (v1, f1) in zip(pts, pts[1:]):
            if v0 <= voxels <= v1:
                w = math.log(voxels / v0) / math.log(v1 / v0) if v1 > v0 else 0.0
                return f0 + w * (f1 - f0)
        return pts[-1][1]

    @property
    def generic(self) -> bool:
        """Whether the figures are the built-in guesses, not measured on a machine."""
        return self.source != "measured"

    @property
    def label(self) -> str:
        """One line saying where the figures come from (printed by the planner)."""
        if self.source == "measured":
            return f"figures measured on {self.measured_at or 'this machine'} ({self.device})"
        if self.source == "generic-gpu":
            return ("GENERIC GPU figures (an H100/H200-class GPU per rank with NVLink, guessed from public "
                    "specifications, not measured): run 'python scripts/benchmark.py calibrate --device cuda'")
        return ("GENERIC CPU figures (this project's 2-core development machine, rounded; not measured here): "
                "run 'python scripts/benchmark.py calibrate'")

    def layer_time(self, key: str, busy: bool) -> float | None:
        """A measured layer time: timed busy where ranks share the machine and it was, else
        timed alone (times the busy slowdown where ranks share it); None if not measured."""
        if busy and key in self.layer_seconds_busy:
            return self.layer_seconds_busy[key]
        alone = self.layer_seconds.get(key)
        if alone is None:
            return None
        return alone * (self.busy_factor if busy else 1.0)

    @classmethod
    def generic_machine(cls, kind: str) -> "Machine":
        """The built-in figures for ``kind`` (``cpu`` or ``gpu``)."""
        if kind == "cpu":
            return cls()
        if kind != "gpu":
            raise ValueError(f"no generic machine {kind!r}; choose cpu or gpu")
        # An H100/H200 SXM per rank, fp32 with TF32 off (the framework's default): FP32 peak ~67
        # TFLOP/s, cuDNN's 3-D convolutions reach a fraction of it; HBM3(e) 3.35-4.8 TB/s;
        # NCCL over NVLink 4 within a node. Guesses, to be replaced by a calibration.
        return cls(default_conv_flops=2.0e13, mem_bandwidth=2.5e12, p2p_alpha=1.5e-5, p2p_beta=1.5e11,
                   ar_alpha=1.5e-5, ar_beta=1.5e11, layer_overhead=5.0e-5, spatial_layer_overhead=2.0e-4,
                   io_bandwidth=2.0e9, baseline_memory=1.5e9, overlap_overhead=3.0e-5, busy_factor=1.0,
                   source="generic-gpu", device="cuda")

    def scaled(self, factor: float) -> None:
        """Compute figures times ``factor`` (a faster device than the calibrated one)."""
        self.conv_flops = {k: (v * factor if isinstance(v, (int, float)) else [[p[0], p[1] * factor, *p[2:]] for p in v])
                           for k, v in self.conv_flops.items()}
        self.default_conv_flops *= factor
        self.mem_bandwidth *= factor
        self.layer_seconds = {k: v / factor for k, v in self.layer_seconds.items()}
        self.layer_seconds_busy = {k: v / factor for k, v in self.layer_seconds_busy.items()}

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Machine":
        """The calibration file ``path``; without one, the default file if it exists, else the
        generic figures (a GPU's where CUDA is available; a missing file that was asked for
        by name is an error). A file from before calibrations said so counts as measured."""
        p = Path(path) if path is not None else default_calibration()
        if not p.is_file():
            if path is not None:
                raise FileNotFoundError(f"calibration file {p} not found; write one with "
                                        "'python scripts/benchmark.py calibrate --calibration FILE'")
            import torch

            return cls.generic_machine("gpu" if torch.cuda.is_available() else "cpu")
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"calibration file {p} is unreadable ({err}); measure it again with "
                             "'python scripts/benchmark.py calibrate'") from None
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{"source": "measured", "measured_at": str(p),
                      **{k: v for k, v in data.items() if k in known}})

