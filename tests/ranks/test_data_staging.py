"""Staging to node-local storage: ranks of a node share the copying; reads stay exact."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import torch

from cosmoflow.convert import write_synthetic
from parallel.data import BlockDataset, PartialShuffleSampler, stage, write_manifest
from parallel.grid import Grid

SPLITS = [(2, 1, 1), (4, 1, 1), (2, 2, 1)]


def _make_source(root: Path, n: int = 6, size: int = 16) -> Path:
    src = root / "shared"
    src.mkdir()
    for i in range(n):
        write_synthetic(src / f"s{i}.h5", 2, 0, i, 1, size, "zstd", SPLITS)
    write_manifest(src, "cosmoflow")
    return src


def _stage_case(grid: Grid, src: str, dest_root: str, mode: str, local_size: int) -> dict:
    """Run on every rank: stage into this node's directory, then read every sample."""
    node = grid.rank // local_size
    dest = Path(dest_root) / f"node{node}"
    report = stage(src, dest, grid, mode=mode, local_size=local_size)
    again = stage(src, dest, grid, mode=mode, local_size=local_size)  # resumable: nothing left
    ds = BlockDataset(report.path, grid=grid)
    reads = [ds.load(i) for i in range(len(ds))]
    ref = BlockDataset(src, grid=grid)
    equal = all(torch.equal(s["volume"], ref[i]["volume"]) and torch.equal(s["target"], ref[i]["target"])
                for i, (s, _, _) in enumerate(reads))
    # Which files were read: the staged ones, never the shared source.
    read_from = sorted({str(ds.locate(i)[0].parent) for i in range(len(ds))})
    return {"bytes": report.bytes, "files": report.files, "bytes_total": report.bytes_total,
            "files_total": report.files_total, "seconds": report.seconds, "again": again.bytes_total,
            "equal": equal, "read_from": read_from}


def test_shard_staging_is_shared_by_the_ranks_of_a_node(pools, tmp_path: Path) -> None:
    src = _make_source(tmp_path)
    results = pools.run(2, _stage_case, str(src), str(tmp_path / "local"), "shard", 2, spatial=(1, 1, 1))
    sizes = sum(p.stat().st_size for p in src.glob("*.h5"))
    assert [r["files"] for r in results] == [3, 3]  # round-robin over the node's 2 ranks
    assert sum(r["bytes"] for r in results) == sizes
    assert all(r["bytes_total"] == sizes and r["files_total"] == 6 for r in results)
    assert all(r["again"] == 0 and r["equal"] and r["seconds"] >= 0 for r in results)
    assert all(r["read_from"] == [str(tmp_path / "local" / "node0")] for r in results)
    for p in src.glob("*.h5"):
        assert (tmp_path / "local" / "node0" / p.name).read_bytes() == p.read_bytes()


def test_block_staging_copies_only_the_nodes_blocks(pools, tmp_path: Path) -> None:
    """2 ranks, spatial 2 along D, one rank per node: each node stages half of each sample."""
    src = _make_source(tmp_path)
    results = pools.run(2, _stage_case, str(src), str(tmp_path / "local"), "blocks", 1, spatial=(2, 1, 1))
    assert all(r["equal"] and r["again"] == 0 for r in results)
    for node in (0, 1):
        d = tmp_path / "local" / f"node{node}"
        assert results[node]["read_from"] == [str(d / f"block_d{node}h0w0")]
        assert sorted(p.name for p in d.iterdir() if p.is_dir()) == [f"block_d{node}h0w0"]
        with h5py.File(d / f"block_d{node}h0w0" / "s0.h5", "r") as f:
            assert f["volume"].shape == (1, 4, 8, 16, 16)
            assert list(f.attrs["block_origin"]) == [8 * node, 0, 0]
    # Each node holds half of every sample's volume bytes (not a full copy).
    source = sum(_volume_bytes(p) for p in src.glob("*.h5"))
    for node in (0, 1):
        staged = sum(_volume_bytes(p) for p in (tmp_path / "local" / f"node{node}").glob("block_*/*.h5"))
        assert 0.4 * source < staged < 0.6 * source, (node, staged, source)
    assert results[0]["bytes_total"] == sum(p.stat().st_size for p in (tmp_path / "local").rglob("*.h5"))


def _volume_bytes(path: Path) -> int:
    with h5py.File(path, "r") as f:
        d = f["volume"].id
        return sum(d.get_chunk_info(i).size for i in range(d.get_num_chunks()))


def test_partial_shuffle_staging_reads_the_rest_from_the_source(tmp_path: Path) -> None:
    src = _make_source(tmp_path, n=8)
    grid = Grid(spatial=(1, 1, 1), world_size=2, rank=0)
    sampler = PartialShuffleSampler(8, grid, global_batch=2, seed=0, exchange=0.5)
    shard = sampler.shard(0)
    report = stage(src, tmp_path / "local", grid, mode="shard", local_size=1, indices=shard)
    assert report.files == len(shard)
    ds = BlockDataset(report.path, grid=grid)
    assert len(ds) == 8  # global numbering is kept
    for i in range(8):
        path, _ = ds.locate(i)
        assert path.parent == (tmp_path / "local" if i in shard else src)
        np.testing.assert_array_equal(ds[i]["volume"].numpy(), BlockDataset(src)[i]["volume"].numpy())
    incoming = sampler.incoming(1)
    more = stage(src, tmp_path / "local", grid, mode="shard", local_size=1, indices=incoming)
    assert more.files == len(incoming) and math.isclose(
        more.bytes, sum((src / f"s{i}.h5").stat().st_size for i in incoming if i not in shard))


def test_block_staging_reused_with_another_split_restages(tmp_path: Path) -> None:
    """The same staging directory, first for spatial (2,1,1), then (1,2,1): block_d0h0w0
    names different extents, so the old block must not be taken for the new one."""
    src = _make_source(tmp_path, n=2)
    dest = tmp_path / "local"
    first = Grid(spatial=(2, 1, 1), world_size=2, rank=0)
    stage(src, dest, first, mode="blocks", local_size=1)
    assert stage(src, dest, first, mode="blocks", local_size=1).bytes == 0  # same split: kept
    second = Grid(spatial=(1, 2, 1), world_size=2, rank=0)
    assert stage(src, dest, second, mode="blocks", local_size=1).bytes > 0
    with h5py.File(dest / "block_d0h0w0" / "s0.h5", "r") as f, h5py.File(src / "s0.h5", "r") as g:
        assert list(f.attrs["splits"].ravel()) == [1, 2, 1]
        assert np.array_equal(f["volume"][...], g["volume"][:, :, :, 0:8, :])


def _stage_unet_blocks(grid: Grid, src: str, dest: str) -> bool:
    """Stage this rank's blocks of U-Net cases of different shapes; read them back."""
    from unet3d.fields import FIELDS

    report = stage(src, Path(dest) / f"rank{grid.rank}", grid, mode="blocks", local_size=1)
    staged, ref = BlockDataset(report.path, fields=FIELDS, grid=grid), BlockDataset(src, fields=FIELDS, grid=grid)
    return all(torch.equal(staged[i][k], ref[i][k]) for i in range(len(ref)) for k in FIELDS)


def test_block_staging_of_cases_of_different_shapes(pools, tmp_path: Path) -> None:
    """Each case is cut by its own shape; the foreground boxes travel whole."""
    from unet3d.convert import write_synthetic as write_case

    src = tmp_path / "cases"
    src.mkdir()
    for i in range(3):
        write_case(src / f"case_{i}.h5", 0, 0, i, [(12, 20), (16, 24), (10, 30)], "none", SPLITS)
    write_manifest(src, "unet3d")
    assert all(pools.run(4, _stage_unet_blocks, str(src), str(tmp_path / "local"), spatial=(2, 2, 1)))
