"""Read-once staging: with a global shuffle every node needs every file, yet the job reads
each byte of the source once; each node's copy is complete and checked; an interrupted
staging resumes. Bytes read are counted by a shared ledger every process draws from
(``SharedBandwidth``), beside staging's own accounting."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from cosmoflow.convert import write_synthetic
from parallel.data import BlockDataset, stage, write_manifest
from parallel.data.bandwidth import SharedBandwidth
from parallel.data.readonce import StagingCheckError
from parallel.grid import Grid

SPLITS = [(2, 1, 1), (2, 2, 1)]
FAST = 1e12  # bytes/s: the ledger counts without slowing anything


def _make_source(root: Path, n: int = 8, size: int = 16) -> Path:
    src = root / "shared"
    src.mkdir()
    for i in range(n):
        write_synthetic(src / f"s{i}.h5", 2, 0, i, 1, size, "zstd", SPLITS)
    write_manifest(src, "cosmoflow")
    return src


def _same_as_source(grid: Grid, staged: Path, src: str) -> bool:
    ds, ref = BlockDataset(staged, grid=grid), BlockDataset(src, grid=grid)
    located = all(ds.locate(i)[0].parent != Path(src) for i in range(len(ds)))
    return located and all(torch.equal(ds[i][k], ref[i][k]) for i in range(len(ref)) for k in ("volume", "target"))


def _stage_both(grid: Grid, src: str, root: str, ledger: str, mode: str, local_size: int) -> dict:
    """Stage with today's staging, then read once, each into its own node directories."""
    node = grid.rank // local_size
    storage = SharedBandwidth(ledger, FAST)
    out = {}
    for name, once in (("each", False), ("once", True)):
        if grid.rank == 0:
            storage.reset()
        torch.distributed.barrier()
        dest = Path(root) / name / f"node{node}"
        report = stage(src, dest, grid, mode=mode, local_size=local_size, read_once=once, storage=storage)
        torch.distributed.barrier()
        out[name] = {"ledger": storage.total(), "source_bytes_total": report.source_bytes_total,
                     "source_bytes": report.source_bytes, "equal": _same_as_source(grid, dest, src)}
    again = stage(src, dest, grid, mode=mode, local_size=local_size, read_once=True, storage=storage)
    out["again_source"] = again.source_bytes_total
    return out


def test_read_once_staging_reads_the_data_set_once_for_all_nodes(pools, tmp_path: Path) -> None:
    """4 ranks as 2 nodes of 2, global shuffle (every node needs every file)."""
    src = _make_source(tmp_path)
    size = sum(p.stat().st_size for p in src.glob("*.h5"))
    results = pools.run(4, _stage_both, str(src), str(tmp_path), str(tmp_path / "ledger"), "shard", 2)
    r = results[0]
    assert r["each"]["ledger"] == 2 * size  # today: every node reads the whole data set
    assert r["once"]["ledger"] == size and r["once"]["source_bytes_total"] == size
    assert sum(x["once"]["source_bytes"] for x in results) == size
    assert all(x["once"]["source_bytes"] > 0 for x in results)  # the reading is shared by every rank
    assert all(x["each"]["equal"] and x["once"]["equal"] for x in results)
    assert r["again_source"] == 0  # staged and checked: nothing to read again
    for node in (0, 1):
        for p in src.glob("*.h5"):
            assert (tmp_path / "once" / f"node{node}" / p.name).read_bytes() == p.read_bytes()


def test_read_once_block_staging_opens_each_file_once(pools, tmp_path: Path) -> None:
    """4 ranks, data 2 x spatial 2, one rank per node: every node needs one block of every
    sample; each file is read by one rank, at most its stored size."""
    src = _make_source(tmp_path)
    results = pools.run(4, _stage_both, str(src), str(tmp_path), str(tmp_path / "ledger"), "blocks", 1,
                        spatial=(2, 1, 1))
    chunks = sum(_volume_bytes(p) for p in src.glob("*.h5"))
    size = sum(p.stat().st_size for p in src.glob("*.h5"))
    r = results[0]
    assert chunks < r["once"]["ledger"] <= size  # each chunk once, not once per node
    assert r["each"]["source_bytes_total"] >= 2 * chunks  # today: two nodes per block position
    assert all(x["once"]["equal"] for x in results) and r["again_source"] == 0
    for node in range(4):
        d = tmp_path / "once" / f"node{node}"
        assert sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")) == \
            [f"block_d{node % 2}h0w0"]


def _volume_bytes(path: Path) -> int:
    with h5py.File(path, "r") as f:
        d = f["volume"].id
        return sum(d.get_chunk_info(i).size for i in range(d.get_num_chunks()))


class _Interrupted(Exception):
    pass


class _StopAfter(SharedBandwidth):
    """A ledger whose ``draws``-th draw in this process raises: the job stopped mid-staging."""

    def __init__(self, path: str, draws: int) -> None:
        super().__init__(path, FAST)
        self.left = draws

    def draw(self, nbytes: int) -> float:
        self.left -= 1
        if self.left < 0:
            raise _Interrupted
        return super().draw(nbytes)


def _interrupt_and_resume(grid: Grid, src: str, root: str, ledger: str) -> dict:
    dest = Path(root) / f"node{grid.rank // 2}"
    try:  # 8 files over 4 ranks: each reads two, and every rank stops at its second
        stage(src, dest, grid, mode="shard", local_size=2, read_once=True, storage=_StopAfter(ledger, 1))
        stopped = False
    except _Interrupted:
        stopped = True
    torch.distributed.barrier()
    held = sorted(p.name for p in dest.glob("*.h5"))
    if grid.rank == 0:  # a copy damaged in place after it was recorded: found and fetched again
        bad = dest / held[0]
        data = bytearray(bad.read_bytes())
        data[-1] ^= 0xFF
        bad.write_bytes(bytes(data))
        SharedBandwidth(ledger, FAST).reset()
    torch.distributed.barrier()
    storage = SharedBandwidth(ledger, FAST)
    report = stage(src, dest, grid, mode="shard", local_size=2, read_once=True, storage=storage)
    torch.distributed.barrier()
    return {"stopped": stopped, "held": held, "ledger": storage.total(), "source": report.source_bytes_total,
            "equal": _same_as_source(grid, dest, src)}


def test_interrupted_read_once_staging_resumes(pools, tmp_path: Path) -> None:
    src = _make_source(tmp_path)
    results = pools.run(4, _interrupt_and_resume, str(src), str(tmp_path / "local"), str(tmp_path / "ledger"))
    assert all(r["stopped"] for r in results)
    held = [set(results[0]["held"]), set(results[2]["held"])]  # node 0, node 1 after the stop
    assert held[0] and held[1] and len(held[0] | held[1]) < 8  # some files staged, not all
    # The resumed staging reads from the source only what no node held soundly; a file one
    # node held comes from that node's copy.
    sizes = {p.name: p.stat().st_size for p in src.glob("*.h5")}
    damaged = sorted(held[0])[0]
    expect = sum(n for name, n in sizes.items() if name not in (held[0] - {damaged}) | held[1])
    assert results[0]["ledger"] == results[0]["source"] == expect
    assert all(r["equal"] for r in results)


def test_a_damaged_copy_stops_staging_naming_it(tmp_path: Path) -> None:
    """The final check compares every staged file with the record made from the source."""
    from parallel.data.readonce import RECORDS, check_staged

    src = _make_source(tmp_path, n=2)
    grid = Grid(spatial=(1, 1, 1), world_size=1, rank=0)
    dest = tmp_path / "local"
    assert stage(src, dest, grid, read_once=True).source_bytes == sum(p.stat().st_size for p in src.glob("*.h5"))
    (dest / "s1.h5").write_bytes(b"x" * (src / "s1.h5").stat().st_size)  # same size, other bytes
    with pytest.raises(StagingCheckError, match=r"s1\.h5: SHA-256 differs"):
        check_staged(dest, ["s0.h5", "s1.h5"], None)
    assert not (dest / "s1.h5").exists() and not (dest / RECORDS / "s1.h5.json").exists()
    assert (dest / "s0.h5").exists()
    again = stage(src, dest, grid, read_once=True)  # fetches what the check removed, only that
    assert again.source_bytes == (src / "s1.h5").stat().st_size
    np.testing.assert_array_equal(BlockDataset(dest)[1]["volume"].numpy(), BlockDataset(src)[1]["volume"].numpy())


def _stage_missing(grid: Grid, src: str, dest: str) -> str:
    try:
        stage(src, Path(dest) / f"node{grid.rank}", grid, local_size=1, read_once=True)
    except OSError as err:
        return str(err)
    return "staged"


def test_a_source_file_that_cannot_be_read_stops_every_rank(pools, tmp_path: Path) -> None:
    """The rank that cannot read tells the others in the round's announcement: nobody waits."""
    src = _make_source(tmp_path, n=4)
    (src / "s1.h5").unlink()  # listed in the manifest, gone from the shared file system
    results = pools.run(2, _stage_missing, str(src), str(tmp_path / "local"), timeout=60)
    assert all("could not read" in r and "s1.h5" in r for r in results), results
