"""What one rank and the network between ranks can do: the figures ``predict`` uses,
measured by ``python scripts/benchmark.py calibrate`` or given on the command line."""

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

    def scaled(self, factor: float) -> None:
        """Compute figures times ``factor`` (a faster device than the calibrated one)."""
        self.conv_flops = {k: (v * factor if isinstance(v, (int, float)) else [[p[0], p[1] * factor, *p[2:]] for p in v])
                           for k, v in self.conv_flops.items()}
        self.default_conv_flops *= factor
        self.mem_bandwidth *= factor
        self.layer_seconds = {k: v / factor for k, v in self.layer_seconds.items()}

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Machine":
        """The calibration file ``path``; without one, the default file if it exists, else the
        defaults above (a missing file that was asked for by name is an error)."""
        p = Path(path) if path is not None else default_calibration()
        if not p.is_file():
            if path is not None:
                raise FileNotFoundError(f"calibration file {p} not found; write one with "
                                        "'python scripts/benchmark.py calibrate --calibration FILE'")
            return cls()
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ValueError(f"calibration file {p} is unreadable ({err}); measure it again with "
                             "'python scripts/benchmark.py calibrate'") from None
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

