"""Per-file jobs of CosmoFlow preparation: synthetic samples and the three converters.

Every job writes its outputs through ``parallel.data.format.write_samples`` (or a
temporary file renamed at the end), so an interrupted job leaves nothing under a final
name and a rerun redoes only what is missing. Each returns the bytes it wrote.

Input layouts (see docs/data.md): MLPerf NumPy (``<name>_data.npy`` int16
(S, S, S, 4) channels-last, ``<name>_label.npy`` float32 (4,)); MLPerf TFRecord (feature
``x`` raw int16 channels-last, ``y`` 4 floats); raw universes (HDF5 ``full`` int16
(N, N, N, 4) channels-last, ``unitPar`` float32 (4,)).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from cosmoflow import synthetic
from cosmoflow.fields import SPEC
from cosmoflow.tfrecord import parse_example, read_records
from parallel.data.format import create_datasets, write_samples

log = logging.getLogger(__name__)

Splits = Sequence[Sequence[int]]


class ConvertError(ValueError):
    """An input file does not have the layout its converter expects."""


def write_synthetic(out: Path, seed: int, split: int, first: int, count: int, size: int,
                    codec: str, splits: Splits) -> int:
    """Samples ``first .. first+count-1`` of ``split`` into one file, filled row by row."""
    tmp = out.with_name(out.name + ".tmp")
    shapes = {"volume": ((count, 4, size, size, size), np.int16), "target": ((count, 4), np.float32)}
    with h5py.File(tmp, "w") as f:
        create_datasets(f, SPEC, shapes, splits, codec,
                        attrs={"source": "synthetic", "seed": seed, "first_index": first})
        for row in range(count):
            volume, target = synthetic.sample(seed, split, first + row, size)
            f["volume"][row] = volume
            f["target"][row] = target
    os.replace(tmp, out)
    return out.stat().st_size


def _channels_first(x: np.ndarray, path: Path, name: str) -> np.ndarray:
    if x.ndim != 4 or x.shape[-1] != 4 or len(set(x.shape[:3])) != 1:
        raise ConvertError(f"{path}: {name} has shape {x.shape}, want (S, S, S, 4) channels-last")
    return np.ascontiguousarray(np.moveaxis(x, -1, 0))


def _target(y: np.ndarray, path: Path) -> np.ndarray:
    y = np.asarray(y, dtype=np.float32).reshape(-1)
    if y.shape != (4,):
        raise ConvertError(f"{path}: target has {y.size} values, want 4")
    return y


def convert_npy(data: Path, label: Path, out: Path, codec: str, splits: Splits) -> int:
    """One MLPerf NumPy sample (``*_data.npy`` + ``*_label.npy``) into one sample file."""
    x = np.load(data, mmap_mode="r", allow_pickle=False)
    if x.dtype != np.int16:
        raise ConvertError(f"{data}: dtype {x.dtype}, want int16")
    volume = _channels_first(x, data, "data")
    target = _target(np.load(label, allow_pickle=False), label)
    write_samples(out, SPEC, {"volume": volume[None], "target": target[None]}, splits, codec,
                  attrs={"source": str(data)})
    return out.stat().st_size


def convert_tfrecord(src: Path, out: Path, codec: str, splits: Splits, size: int = 0) -> int:
    """Every record of one TFRecord file (gzip or plain) into one sample file."""
    volumes, targets = [], []
    for i, record in enumerate(read_records(src)):
        example = parse_example(record)
        if "x" not in example or "y" not in example:
            raise ConvertError(f"{src}: record {i} has features {sorted(example)}, want 'x' and 'y'")
        kind, values = example["x"]
        if kind != "bytes" or len(values) != 1:
            raise ConvertError(f"{src}: record {i}: feature 'x' is {kind} x{len(values)}, want one bytes value")
        raw = np.frombuffer(values[0], dtype="<i2")
        side = size or round((raw.size // 4) ** (1 / 3))
        if raw.size != 4 * side ** 3:
            raise ConvertError(f"{src}: record {i}: 'x' holds {raw.size} int16 values, "
                               f"not 4 x {side}^3 = {4 * side ** 3}")
        volumes.append(_channels_first(raw.reshape(side, side, side, 4), src, "x"))
        kind, y = example["y"]
        if kind != "float":
            raise ConvertError(f"{src}: record {i}: feature 'y' is {kind}, want a float list")
        targets.append(_target(y, src))
    if not volumes:
        raise ConvertError(f"{src}: holds no records")
    write_samples(out, SPEC, {"volume": np.stack(volumes).astype(np.int16),
                              "target": np.stack(targets)}, splits, codec, attrs={"source": str(src)})
    return out.stat().st_size


def universe_outputs(src: Path, out_dir: Path, crop: int, side: int) -> list[Path]:
    """Output files of one universe: one whole box, or ``(side // crop)^3`` crops."""
    if not crop or crop >= side:
        return [out_dir / f"{src.stem}.h5"]
    n = (side // crop) ** 3
    return [out_dir / f"{src.stem}_{i:03d}.h5" for i in range(n)]


def convert_universe(src: Path, out_dir: Path, crop: int, codec: str, splits: Splits) -> int:
    """A raw simulation box into one whole-box file or its crops (D, then H, then W).

    The box is read in depth slabs (one crop thick), never whole, and transposed to
    channels-first slab by slab; ``unitPar`` is copied to every crop.
    """
    written = 0
    with h5py.File(src, "r") as f:
        if "full" not in f or "unitPar" not in f:
            raise ConvertError(f"{src}: has {sorted(f.keys())}, want 'full' and 'unitPar'")
        full = f["full"]
        if full.ndim != 4 or full.shape[-1] != 4 or len(set(full.shape[:3])) != 1 or full.dtype != np.int16:
            raise ConvertError(f"{src}: 'full' is {full.dtype} {full.shape}, want int16 (N, N, N, 4)")
        target = _target(f["unitPar"][...], src)
        side = full.shape[0]
        outputs = universe_outputs(src, out_dir, crop, side)
        if len(outputs) == 1:
            return _whole_box(full, target, outputs[0], codec, splits, src)
        if side % crop:
            raise ConvertError(f"{src}: a box of {side} does not cut into crops of {crop}")
        k = side // crop
        for cd in range(k):
            names = outputs[cd * k * k:(cd + 1) * k * k]
            if all(p.exists() for p in names):
                continue
            slab = np.moveaxis(full[cd * crop:(cd + 1) * crop], -1, 0)  # (4, crop, N, N)
            for j, out in enumerate(names):
                if out.exists():
                    continue
                ch, cw = divmod(j, k)
                block = np.ascontiguousarray(slab[:, :, ch * crop:(ch + 1) * crop, cw * crop:(cw + 1) * crop])
                write_samples(out, SPEC, {"volume": block[None], "target": target[None]}, splits, codec,
                              attrs={"source": str(src), "crop_index": cd * k * k + j})
                written += out.stat().st_size
    return written


def _whole_box(full: h5py.Dataset, target: np.ndarray, out: Path, codec: str, splits: Splits,
               src: Path) -> int:
    side = full.shape[0]
    tmp = out.with_name(out.name + ".tmp")
    with h5py.File(tmp, "w") as g:
        create_datasets(g, SPEC, {"volume": ((1, 4, side, side, side), np.int16),
                                  "target": ((1, 4), np.float32)}, splits, codec, attrs={"source": str(src)})
        # Whole chunk layers per slab: a compressed chunk is never written twice.
        layer = g["volume"].chunks[2]
        step = max(layer, (64 << 20) // (side * side * 4 * 2) // layer * layer)
        for d in range(0, side, step):
            g["volume"][0, :, d:d + step] = np.moveaxis(full[d:d + step], -1, 0)
        g["target"][0] = target
    os.replace(tmp, out)
    return out.stat().st_size
