"""The block reader: each rank reads its block, only its block, and says what it read."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from cosmoflow import fields as cosmo_fields
from cosmoflow.convert import write_synthetic
from parallel.data import (
    BlockDataset,
    GlobalShuffleSampler,
    SampleReadError,
    choose_chunks,
    make_loader,
    write_manifest,
    write_samples,
)
from parallel.data.codecs import codec_kwargs
from parallel.data.format import parse_splits
from parallel.grid import Grid
from unet3d import fields as unet_fields
from unet3d.convert import write_synthetic as write_unet

SPLITS = [(2, 1, 1), (4, 1, 1), (2, 2, 1)]
CODECS = ["none", "gzip", "lz4", "zstd", "blosc2"]
SIZE = 32


@pytest.fixture(scope="module")
def cosmo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 32^3 synthetic CosmoFlow sample per codec, chunked for SPLITS."""
    root = tmp_path_factory.mktemp("cosmo")
    out = {}
    for codec in CODECS:
        out[codec] = root / f"{codec}.h5"
        write_synthetic(out[codec], seed=0, split=0, first=0, count=1, size=SIZE, codec=codec, splits=SPLITS)
    return out


def _grids(spatial: tuple[int, int, int]) -> list[Grid]:
    s = math.prod(spatial)
    return [Grid(spatial=spatial, world_size=s, rank=r) for r in range(s)]


def _stored_bytes(dset: h5py.Dataset) -> tuple[int, int]:
    """Total stored bytes of a dataset's chunks and the largest chunk's stored size."""
    sizes = [dset.id.get_chunk_info(i).size for i in range(dset.id.get_num_chunks())]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("spatial", SPLITS, ids=lambda s: "x".join(map(str, s)))
def test_blocks_equal_slices_of_a_full_read(cosmo_files: dict[str, Path], codec: str,
                                            spatial: tuple[int, int, int]) -> None:
    with h5py.File(cosmo_files[codec], "r") as f:
        full, target = f["volume"][0], f["target"][0]
    for grid in _grids(spatial):
        sample = BlockDataset([cosmo_files[codec]], grid=grid)[0]
        block = full[(slice(None),) + grid.block_slices(full.shape[1:])]
        assert sample["volume"].shape == block.shape
        np.testing.assert_array_equal(sample["volume"].numpy(), block)
        np.testing.assert_array_equal(sample["target"].numpy(), target)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("spatial", SPLITS, ids=lambda s: "x".join(map(str, s)))
def test_each_rank_reads_about_one_share_of_the_sample(cosmo_files: dict[str, Path], codec: str,
                                                       spatial: tuple[int, int, int]) -> None:
    path = cosmo_files[codec]
    s = math.prod(spatial)
    with h5py.File(path, "r") as f:
        stored, biggest = _stored_bytes(f["volume"])
        raw_chunk = math.prod(f["volume"].chunks) * 2
    file_bytes = path.stat().st_size
    whole = BlockDataset([path], io="counting").load(0)[1]
    assert whole >= stored  # the counting file sees at least every chunk of a whole read
    for grid in _grids(spatial):
        chunk_bytes = BlockDataset([path], grid=grid).load(0)[1]
        assert chunk_bytes <= 1.1 * stored / s + biggest + 16, (grid.coords, chunk_bytes, stored)
        # The bytes HDF5 really pulled from the file (metadata included): about 1/S of it.
        real = BlockDataset([path], grid=grid, io="counting").load(0)[1]
        assert real <= 1.1 * file_bytes / s + raw_chunk, (grid.coords, real, file_bytes)
        assert real < 0.75 * whole


def test_chunks_tile_the_block_boundaries_of_every_split() -> None:
    for volume, splits in [((32, 32, 32), SPLITS), ((128, 96, 64), parse_splits("2,4,2x2x1,2x2x2")),
                           ((512, 512, 512), parse_splits("8,4x2x2"))]:
        chunks = choose_chunks(volume, splits, 4, 2)
        assert chunks[:2] == (1, 4)
        for spatial in splits:
            for grid in _grids(spatial):
                for (a, b), c in zip(grid.block_range(volume), chunks[2:]):
                    assert a % c == 0 and b % c == 0, (volume, spatial, chunks)
        assert math.prod(chunks) * 2 <= max(1 << 20, 4 * 8 ** 3 * 2)


def test_uneven_split_reads_the_right_block(tmp_path: Path) -> None:
    """Uneven blocks (30 = 8+8+7+7) cannot be tiled by chunks, but reads stay exact."""
    rng = np.random.default_rng(0)
    vol = rng.integers(0, 100, size=(2, 4, 30, 30, 30), dtype=np.int16)
    tgt = rng.uniform(-1, 1, size=(2, 4)).astype(np.float32)
    path = write_samples(tmp_path / "u.h5", cosmo_fields.SPEC, {"volume": vol, "target": tgt},
                         splits=[(4, 1, 1)], codec="zstd")
    for grid in _grids((4, 1, 1)):
        ds = BlockDataset([path], grid=grid)
        for i in range(2):
            np.testing.assert_array_equal(ds[i]["volume"].numpy(), vol[i][(slice(None),) + grid.block_slices((30, 30, 30))])
            np.testing.assert_array_equal(ds[i]["target"].numpy(), tgt[i])


def test_a_file_rewritten_after_its_handle_closed_is_read_afresh(tmp_path: Path) -> None:
    """The reader keeps each open file's datasets and block hyperslabs (looked up once per
    handle); a handle evicted by ``max_open_files`` drops them, so a file replaced with
    another layout (other chunks, other offsets) is read as it is now, not as it was."""
    rng = np.random.default_rng(3)
    grid = Grid(spatial=(2, 2, 1), world_size=4, rank=3)
    paths = [tmp_path / "a.h5", tmp_path / "b.h5"]

    def write(path: Path, splits: list[tuple[int, int, int]]) -> np.ndarray:
        vol = rng.integers(0, 1000, size=(1, 4, 32, 32, 32), dtype=np.int16)
        tgt = rng.uniform(-1, 1, size=(1, 4)).astype(np.float32)
        write_samples(path, cosmo_fields.SPEC, {"volume": vol, "target": tgt}, splits=splits, codec="none")
        return vol[0][(slice(None),) + grid.block_slices((32, 32, 32))]

    first = write(paths[0], [(2, 2, 1)])
    other = write(paths[1], [(2, 2, 1)])
    ds = BlockDataset(paths, grid=grid, max_open_files=1)
    np.testing.assert_array_equal(ds[0]["volume"].numpy(), first)
    np.testing.assert_array_equal(ds[0]["volume"].numpy(), first)  # from the kept layout
    np.testing.assert_array_equal(ds[1]["volume"].numpy(), other)  # evicts a.h5's handle and layout
    with h5py.File(paths[0], "r") as f:
        chunks_before = f["volume"].chunks
    second = write(paths[0], [(4, 1, 1), (1, 1, 8)])
    with h5py.File(paths[0], "r") as f:
        assert f["volume"].chunks != chunks_before
    np.testing.assert_array_equal(ds[0]["volume"].numpy(), second)
    ds.close()


def test_many_samples_per_file_and_many_files(tmp_path: Path) -> None:
    for first in (0, 3):
        write_synthetic(tmp_path / f"s{first}.h5", 7, 0, first, 3, 16, "lz4", SPLITS)
    write_manifest(tmp_path, "cosmoflow")
    grid = Grid(spatial=(2, 1, 1), world_size=2, rank=1)
    ds = BlockDataset(tmp_path, fields=("volume", "target"), grid=grid)
    assert len(ds) == 6
    from cosmoflow.synthetic import sample
    for i in range(6):
        volume, target = sample(7, 0, i, 16)
        np.testing.assert_array_equal(ds[i]["volume"].numpy(), volume[:, 8:])
        np.testing.assert_array_equal(ds[i]["target"].numpy(), target)


def test_transforms_run_on_the_block(cosmo_files: dict[str, Path], tmp_path: Path) -> None:
    grid = Grid(spatial=(2, 2, 1), world_size=4, rank=3)
    raw = BlockDataset([cosmo_files["none"]], grid=grid)[0]["volume"]
    out = BlockDataset([cosmo_files["none"]], grid=grid, transform=cosmo_fields.transform)[0]["volume"]
    assert out.dtype == torch.float32 and out.shape == (4, 16, 16, 32)
    torch.testing.assert_close(out, torch.log1p(raw.double()).float())  # float32 log1p vs double: 1 ulp

    path = tmp_path / "case.h5"
    write_unet(path, 0, 0, 0, 16, "none", SPLITS)
    ds = BlockDataset([path], grid=grid)
    fn = unet_fields.transform_for(ds.attrs)
    assert fn is unet_fields.transform
    raw_u = ds[0]
    got = fn(raw_u)
    assert got["image"].shape == (1, 8, 8, 16) and got["label"].shape == (8, 8, 16)
    want = (raw_u["image"].clamp(-79.0, 304.0) - 101.0) / 76.9
    torch.testing.assert_close(got["image"], want)
    assert got["label"].dtype == torch.int64


def test_loader_batches_follow_the_sampler_and_report_io(tmp_path: Path) -> None:
    for i in range(8):
        write_synthetic(tmp_path / f"s{i}.h5", 1, 0, i, 1, 16, "zstd", SPLITS)
    write_manifest(tmp_path, "cosmoflow")
    grid = Grid(spatial=(2, 1, 1), world_size=4, rank=2)  # data rank 1, block 0
    ds = BlockDataset(tmp_path, grid=grid, transform=cosmo_fields.transform)
    sampler = GlobalShuffleSampler(len(ds), grid, global_batch=4, seed=3)
    sampler.set_epoch(1)
    expected = list(sampler)
    loader = make_loader(ds, sampler, num_workers=2, prefetch_factor=2)
    steps = list(loader)
    assert len(steps) == len(expected) == 2
    for (batch, stats), indices in zip(steps, expected):
        assert batch["volume"].shape == (2, 4, 8, 16, 16)
        want = torch.stack([ds[i]["volume"] for i in indices])
        torch.testing.assert_close(batch["volume"], want)
        assert stats.samples == 2 and stats.bytes_read > 0
        assert stats.read_seconds > 0 and stats.wait_seconds >= 0
    assert loader.totals.bytes_read == sum(s.bytes_read for _, s in steps)
    assert loader.state_dict()["step"] == 2

    # Resume after one delivered step: the next step is the second one.
    state = {**loader.state_dict(), "step": 1}
    loader2 = make_loader(ds, GlobalShuffleSampler(len(ds), grid, 4, seed=3), num_workers=0)
    loader2.load_state_dict(state)
    (batch, _), = list(loader2)
    torch.testing.assert_close(batch["volume"], steps[1][0]["volume"])


def test_a_truncated_file_is_named_by_the_reader(tmp_path: Path) -> None:
    for i in range(4):
        write_synthetic(tmp_path / f"s{i}.h5", 1, 0, i, 1, 16, "gzip", SPLITS)
    bad = tmp_path / "s2.h5"
    data = bad.read_bytes()
    grid = Grid(spatial=(2, 1, 1), world_size=2, rank=0)
    ds = BlockDataset(tmp_path, grid=grid)
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(SampleReadError, match="s2.h5"):
        ds[2]
    loader = make_loader(ds, GlobalShuffleSampler(4, grid, 4, shuffle=False), num_workers=1)
    with pytest.raises(Exception, match="s2.h5"):
        list(loader)


def test_a_corrupt_compressed_chunk_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.h5"
    write_synthetic(path, 1, 0, 0, 1, 16, "zstd", SPLITS)
    with h5py.File(path, "r") as f:
        info = f["volume"].id.get_chunk_info(0)
    raw = bytearray(path.read_bytes())
    raw[info.byte_offset:info.byte_offset + info.size] = b"\x55" * info.size
    path.write_bytes(bytes(raw))
    grid = Grid(spatial=(2, 1, 1), world_size=2, rank=0)  # block 0 holds chunk 0
    with pytest.raises(SampleReadError, match=r"c\.h5: field 'volume' sample 0 hyperslab"):
        BlockDataset([path], grid=grid)[0]


def test_an_empty_tail_step_yields_zero_length_tensors(tmp_path: Path) -> None:
    for i in range(5):
        write_synthetic(tmp_path / f"s{i}.h5", 1, 0, i, 1, 8, "none", [(1, 1, 1)])
    grid = Grid(spatial=(1, 1, 1), world_size=4, rank=3)
    ds = BlockDataset(tmp_path, grid=grid, transform=cosmo_fields.transform)
    loader = make_loader(ds, GlobalShuffleSampler(5, grid, 4, drop_last=False), num_workers=1)
    (first, s1), (tail, s2) = list(loader)
    assert first["volume"].shape == (1, 4, 8, 8, 8) and s1.samples == 1
    assert tail["volume"].shape == (0, 4, 8, 8, 8) and tail["volume"].dtype == torch.float32
    assert tail["target"].shape == (0, 4) and s2.samples == 0 and s2.bytes_read == 0


def test_direct_chunk_reads_equal_hdf5s(tmp_path: Path) -> None:
    """Whole-chunk hyperslabs of unfiltered data read with plain preads (into the output's
    long runs, or staged for short runs, partial edge chunks and unwritten chunks) equal
    HDF5's own read, and count the chunks' stored bytes; other selections are not taken."""
    import os

    from parallel.data import direct

    rng = np.random.default_rng(0)
    data = rng.integers(-500, 500, size=(2, 3, 20, 32, 48), dtype=np.int16)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("runs", data=data, chunks=(1, 3, 4, 32, 48))     # whole H x W: long runs
        f.create_dataset("short", data=data, chunks=(1, 1, 4, 8, 8))      # 16-byte runs: staged
        f.create_dataset("edge", data=data, chunks=(1, 3, 8, 16, 48))     # 20 = 8 + 8 + a partial 4
        holes = f.create_dataset("holes", shape=data.shape, dtype=np.int16, chunks=(1, 3, 4, 16, 48), fillvalue=-7)
        holes[:, :, :8] = data[:, :, :8]                                  # the later chunks stay unwritten
        f.create_dataset("zstd", data=data, chunks=(1, 3, 4, 32, 48), **codec_kwargs("zstd"))
    fd = os.open(path, os.O_RDONLY)
    try:
        with h5py.File(path, "r", rdcc_nbytes=0) as f:
            for name in ("runs", "short", "edge", "holes"):
                dset = f[name]
                for sel in [(slice(1, 2), slice(0, 3), slice(8, 16), slice(0, 32), slice(0, 48)),
                            (slice(0, 1), slice(0, 3), slice(0, 20), slice(0, 32), slice(0, 48)),
                            (slice(0, 2), slice(0, 3), slice(16, 20), slice(16, 32), slice(0, 48))]:
                    if not direct.applies(dset, sel):
                        assert name in ("runs", "holes") and sel[3].start == 16 and dset.chunks[3] == 32
                        continue
                    got, nbytes = direct.read(dset, sel, fd)
                    np.testing.assert_array_equal(got, dset[sel], err_msg=f"{name} {sel}")
                    chunk_bytes = direct_bytes = 0
                    for corner in itertools.product(*(range(s.start, s.stop, c) for s, c in zip(sel, dset.chunks))):
                        info = dset.id.get_chunk_info_by_coord(corner)
                        chunk_bytes += int(info.size or 0) if info.byte_offset is not None else 0
                    direct_bytes = nbytes
                    assert direct_bytes == chunk_bytes, (name, sel)
            assert not direct.applies(f["zstd"], (slice(0, 1), slice(0, 3), slice(0, 4), slice(0, 32), slice(0, 48)))
            assert not direct.applies(f["runs"], (slice(0, 1), slice(0, 3), slice(2, 6), slice(0, 32), slice(0, 48)))
    finally:
        os.close(fd)
    # The reader takes the direct path for block reads of files chunked for the split.
    vol = rng.integers(0, 100, size=(1, 4, 16, 16, 16), dtype=np.int16)
    p = write_samples(tmp_path / "s.h5", cosmo_fields.SPEC, {"volume": vol, "target": np.zeros((1, 4), np.float32)},
                      splits=[(2, 1, 1)], codec="none")
    grid = next(iter(_grids((2, 1, 1))))
    ds = BlockDataset([p], grid=grid)
    sample, nbytes, _ = ds.load(0)
    np.testing.assert_array_equal(sample["volume"].numpy(), vol[0][(slice(None),) + grid.block_slices((16, 16, 16))])
    assert nbytes == vol[0].nbytes // 2 + 16 and ds._fds, "the block read did not take the direct path"
    ds.close()
    assert not ds._fds


def test_uncompressed_chunks_keep_h_and_w_whole_where_they_can() -> None:
    """Unfiltered chunks (read as their runs in the block) are halved along D first: they
    still tile every split's blocks, stay within 4 MiB, and keep W (and H where the splits
    allow) whole."""
    splits = parse_splits("2,4,2x2x1")
    chunks = choose_chunks((256, 256, 256), splits, 4, 2, uncompressed=True)
    assert chunks == (1, 4, 16, 128, 256)
    assert math.prod(chunks) * 2 <= 4 << 20
    for spatial in splits:
        for grid in _grids(spatial):
            for (a, b), c in zip(grid.block_range((256, 256, 256)), chunks[2:]):
                assert a % c == 0 and b % c == 0
    assert choose_chunks((256, 256, 256), splits, 4, 2) != chunks  # compressed: the 1 MiB cubes
