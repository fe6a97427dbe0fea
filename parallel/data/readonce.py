"""Read-once staging: the nodes of a job split the data set's files, each file is read
once from the shared file system, and the nodes hand each other what they need.

Today's staging (``parallel.data.staging``) lets every node copy what it needs: with a
global shuffle every node needs every file, so ``N`` nodes read the data set ``N``
times from the shared file system. Here (``stage(..., read_once=True)``):

1. every node says what it needs (``indices``: whole files in ``shard`` mode; in
   ``blocks`` mode the blocks of its ranks' spatial positions) and what it already holds
   (an earlier, interrupted staging: files with their checksum record);
2. each source file that some node still lacks gets one reader among the ranks of the
   nodes that need it (the least loaded first), or, in ``shard`` mode, a rank of a node
   that already holds a checked copy (which then reads its local copy: no shared read);
3. in rounds, every rank reads its next file once (``shard``: its bytes; ``blocks``: the
   box around every block any node lacks, then cuts each block into a small sample file
   in memory), computes each payload's SHA-256, and the payloads travel over the grid's
   CPU (gloo) group to one rank of every node that lacks them (``comm.exchange``:
   point-to-point, sizes announced first by an all-gather of a JSON list, never a
   pickle); the receiving rank checks the checksum and writes the file via a temporary
   name, its record (size, SHA-256, the source file's path) beside it under
   ``.staged/`` (a copy counts as held only for the same source file); a thread reads
   the next round's file meanwhile;
4. before returning, every node checks every file it needs: size and SHA-256 against
   the record made when the bytes came from the source; a failure on any node stops
   every rank with the files named (and removes them, so a rerun fetches them again).

Bytes read from the shared file system per job: the data set's stored size once
(``shard``), or the boxes of the blocks the nodes need, each file opened once
(``blocks``). Each source read is counted (``source_bytes``) and drawn from
``storage`` when given (``parallel.data.bandwidth``, for measurements).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import h5py
import numpy as np
import torch

from parallel import comm
from parallel.data.accounting import CountingFile
from parallel.data.codecs import codec_kwargs
from parallel.data.format import choose_chunks
from parallel.data.reader import block_dir_name

log = logging.getLogger(__name__)

RECORDS = ".staged"
"""Subdirectory of the destination holding one JSON record (size, SHA-256) per staged file."""
_READ = 4 << 20


class StagingCheckError(RuntimeError):
    """A staged file's size or checksum differs from the source's; names the files."""


def all_nodes(grid: Any, local_size: int | None) -> list[list[int]]:
    """The ranks of every node of the job, in order of their first rank."""
    if local_size is None:
        placement = getattr(grid, "placement", None)
        if placement is None:
            return [[r] for r in range(grid.world_size)]
        return [placement.ranks_on(n) for n in placement.nodes]
    return [list(range(a, min(a + local_size, grid.world_size))) for a in range(0, grid.world_size, local_size)]


def _gather_json(value: Any, group: Any) -> list[Any]:
    raw = comm.all_gather_bytes(json.dumps(value).encode(), group, caller="staging (read once)")
    return [json.loads(b.decode()) for b in raw]


def _record_path(dest: Path, rel: str) -> Path:
    return dest / RECORDS / f"{rel}.json"


def _held(dest: Path, items: dict[str, str], splits: list[int] | None) -> dict[str, list]:
    """Of ``items`` (paths relative to ``dest`` -> the source file they come from), those
    present, of their record's size and SHA-256, staged from that same source file (a
    folder staged from another directory holds other samples under the same names) and,
    for blocks, cut for the same split: {rel: [size, sha256]}. Reads every file present
    (node-local storage): a copy that may serve other nodes must be sound."""
    held = {}
    for rel, source in items.items():
        rec, path = _record_path(dest, rel), dest / rel
        try:
            r = json.loads(rec.read_text(encoding="utf-8"))
            if (path.stat().st_size == r["size"] and r.get("source") == source
                    and (splits is None or r.get("splits") == splits)
                    and _sha256_file(path) == r["sha256"]):
                held[rel] = [r["size"], r["sha256"]]
        except (OSError, ValueError, KeyError):
            continue
    return held


def _read_source(path: Path, storage: Any) -> tuple[np.ndarray, int]:
    """Every byte of ``path`` (a numpy uint8 array) and the bytes read; each piece read is
    drawn from ``storage`` when given."""
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        out = np.empty(size, np.uint8)
        view, got = memoryview(out), 0
        while got < size:
            n = fh.readinto(view[got:got + _READ])
            if not n:
                raise OSError(f"{path}: short read ({got} of {size} bytes)")
            got += n
            if storage is not None:
                storage.draw(n)
    return out, got


def _cut_blocks(path: Path, grid: Any, wanted: list[tuple[int, int, int]], storage: Any
                ) -> tuple[dict[tuple[int, int, int], bytes], int]:
    """Open ``path`` once and read the box around the blocks at ``wanted``; each block as
    the image of a small sample file (as ``staging._copy_block`` writes it), and the bytes
    read from the file. When the blocks cover the volume, the file is read whole, in
    large reads, and cut in memory (exactly its size); else HDF5 reads the box (every
    byte it asks for counted, metadata included)."""
    whole = len(set(wanted)) == grid.spatial_size
    counter: Any = None
    if whole:
        data, nbytes = _read_source(path, storage)
        handle: Any = io.BytesIO(data.tobytes())
    else:
        handle = counter = CountingFile(path)
    images: dict[tuple[int, int, int], bytes] = {}
    try:
        with h5py.File(handle, "r", rdcc_nbytes=0) as f:
            shape = tuple(int(s) for s in f.attrs.get("global_shape", ()))
            origin = np.asarray(f.attrs.get("block_origin", (0, 0, 0)), dtype=np.int64)
            if len(shape) != 3 or origin.any():
                raise ValueError(f"{path}: not a full-volume sample file (global_shape {shape}, "
                                 f"block_origin {origin.tolist()})")
            ranges = {c: grid.block_range(shape, c) for c in wanted}
            box = [(min(r[d][0] for r in ranges.values()), max(r[d][1] for r in ranges.values())) for d in range(3)]
            codec = str(f.attrs.get("codec", "none"))
            attrs = dict(f.attrs.items())
            volumes, scalars = {}, {}
            for name, dset in f.items():
                if dset.ndim >= 4 and tuple(dset.shape[-3:]) == shape:
                    volumes[name] = dset[(Ellipsis,) + tuple(slice(a, b) for a, b in box)]
                else:
                    scalars[name] = dset[...]
        for c, rng in ranges.items():
            buf = io.BytesIO()
            with h5py.File(buf, "w") as g:
                for key, value in attrs.items():
                    g.attrs[key] = value
                for name, whole in volumes.items():
                    block = whole[(Ellipsis,) + tuple(slice(a - a0, b - a0) for (a, b), (a0, _) in zip(rng, box))]
                    channels = block.shape[1] if block.ndim == 5 else None
                    chunks = choose_chunks(block.shape[-3:], [(1, 1, 1)], channels, block.dtype.itemsize)
                    chunks = (min(chunks[0], block.shape[0]),) + chunks[1:]
                    g.create_dataset(name, data=block, chunks=chunks, **codec_kwargs(codec))
                for name, value in scalars.items():
                    g.create_dataset(name, data=value)
                g.attrs["block_origin"] = np.asarray([a for a, _ in rng], dtype=np.int64)
                g.attrs["block_shape"] = np.asarray([b - a for a, b in rng], dtype=np.int64)
                g.attrs["splits"] = np.asarray([grid.spatial], dtype=np.int64)
            images[c] = buf.getvalue()
    finally:
        if counter is not None:
            counter.close()
    if counter is not None:
        nbytes = counter.bytes_read
        if storage is not None:
            storage.draw(nbytes)
    return images, nbytes


def _write(dest: Path, rel: str, data: Any, sha: str, splits: list[int] | None, source: str) -> int:
    """Write ``data`` at ``dest/rel`` via a temporary name, its record first (with the
    source file it came from); bytes written."""
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        raise StagingCheckError(f"{dest / rel}: received bytes have SHA-256 {got}, the reader's is {sha}")
    out, rec = dest / rel, _record_path(dest, rel)
    out.parent.mkdir(parents=True, exist_ok=True)
    rec.parent.mkdir(parents=True, exist_ok=True)
    size = memoryview(data).nbytes
    tmp = rec.with_name(f"{rec.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"size": size, "sha256": sha, "splits": splits, "source": source}), encoding="utf-8")
    os.replace(tmp, rec)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, out)
    return size


def _source_id(path: Path) -> str:
    """The source file a staged copy's record names: its absolute path."""
    return str(Path(path).resolve())


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def stage_read_once(files: list[Path], dest: Path, grid: Any, mode: str, local_size: int | None,
                    wanted: list[int], storage: Any = None) -> dict[str, int]:
    """The collective part of ``stage(..., read_once=True)``: see the module's docstring.
    ``wanted``: the indices (into ``files``) this rank's node needs. Returns this rank's
    counts: ``bytes`` written here, ``files`` written here, ``source_bytes`` read from the
    shared source, ``local_bytes`` read from a local copy, ``sent_bytes``, ``received_bytes``."""
    group = getattr(grid, "cpu_group", None)
    nodes = all_nodes(grid, local_size)
    node_of = {r: n for n, ranks in enumerate(nodes) for r in ranks}
    me = node_of[grid.rank]
    splits = [list(grid.spatial)] if mode == "blocks" else None

    def items_of(node: int, want: Sequence[int]) -> list[tuple[int, tuple[int, int, int] | None]]:
        if mode == "shard":
            return [(i, None) for i in want]
        positions = sorted({grid.spatial_coords(r % grid.spatial_size) for r in nodes[node]})
        return [(i, c) for i in want for c in positions]

    def rel(item: tuple[int, tuple[int, int, int] | None]) -> str:
        i, c = item
        return files[i].name if c is None else f"{block_dir_name(c)}/{files[i].name}"

    # 1. What each node needs and holds (one report per node: its first rank's).
    local_rank = nodes[me].index(grid.rank)
    mine = items_of(me, wanted)
    sources = {rel(x): _source_id(files[x[0]]) for x in mine}
    report = {"wanted": sorted(set(wanted)), "held": _held(dest, sources, splits)} if local_rank == 0 else None
    reports = _gather_json(report, group)
    need: dict[int, list] = {}  # node -> items it needs
    held: dict[int, dict[str, list]] = {}
    for n, ranks in enumerate(nodes):
        r = reports[ranks[0]]
        need[n] = items_of(n, r["wanted"])
        held[n] = r["held"]
    # 2. Per source file: who lacks what, and who reads it.
    lacking: dict[int, list[tuple[int, tuple[int, int, int] | None]]] = {}
    for n in range(len(nodes)):
        for item in need[n]:
            if rel(item) not in held[n]:
                lacking.setdefault(item[0], []).append((n, item[1]))
    load = {r: 0 for r in range(grid.world_size)}
    plan: dict[int, list[tuple[int, bool]]] = {r: [] for r in range(grid.world_size)}  # rank -> (file, from copy)
    for i in sorted(lacking):
        keepers = [n for n in range(len(nodes)) if mode == "shard" and files[i].name in held[n]]
        pool = keepers or sorted({n for n, _ in lacking[i]})
        reader = min((r for n in pool for r in nodes[n]), key=lambda r: (load[r], r))
        load[reader] += 1
        plan[reader].append((i, bool(keepers)))
    counts: dict[str, Any] = dict(bytes=0, files=0, source_bytes=0, local_bytes=0, sent_bytes=0, received_bytes=0,
                                  read_s=0.0, exchange_s=0.0, write_s=0.0, check_s=0.0)
    sent_to = {n: 0 for n in range(len(nodes))}  # payloads each node has been handed: spreads the writes
    # 3. Rounds: each rank reads its next file once; the payloads go to the nodes lacking them.
    def fetch(k: int) -> tuple[dict[str, Any], Any, int, int]:
        """This rank's file of round ``k``: its payloads, their announcement (or the error),
        the bytes read from the source and from a local copy."""
        if k >= len(plan[grid.rank]):
            return {}, None, 0, 0
        i, from_copy = plan[grid.rank][k]
        payloads: dict[str, Any] = {}  # rel -> bytes
        try:
            if mode == "shard":
                path = dest / files[i].name if from_copy else files[i]
                data, n = _read_source(path, None if from_copy else storage)
                payloads[files[i].name] = data
            else:
                images, n = _cut_blocks(files[i], grid, sorted({c for _, c in lacking[i]}), storage)
                payloads.update({rel((i, c)): v for c, v in images.items()})
        except (OSError, ValueError, KeyError) as err:  # told to every rank: they stop together
            return {}, {"error": f"rank {grid.rank}: {files[i]}: {err}"}, 0, 0
        listed = [[name, memoryview(d).nbytes, hashlib.sha256(d).hexdigest()] for name, d in payloads.items()]
        return payloads, [i, listed], 0 if from_copy else n, n if from_copy else 0

    rounds = max(len(v) for v in plan.values())
    # A thread reads the next round's file while this round's payloads travel and are written.
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(fetch, 0)
        for k in range(rounds):
            t0 = time.perf_counter()
            payloads, mine_now, from_source, from_copy = ahead.result()
            if k + 1 < rounds:
                ahead = pool.submit(fetch, k + 1)
            counts["source_bytes"] += from_source
            counts["local_bytes"] += from_copy
            t1 = time.perf_counter()
            announced = _gather_json(mine_now, group)
            errors = [e["error"] for e in announced if isinstance(e, dict)]
            if errors:
                raise OSError("staging (read once) could not read: " + "; ".join(errors[:10]))
            sends, recvs, writes = [], [], []
            tensors: dict[str, torch.Tensor] = {}
            for reader, entry in enumerate(announced):
                if entry is None:
                    continue
                i, listed = entry
                for name, size, sha in listed:
                    for n, c in lacking[i]:
                        if rel((i, c)) != name:
                            continue
                        writer = reader if node_of[reader] == n else nodes[n][sent_to[n] % len(nodes[n])]
                        sent_to[n] += writer != reader
                        if reader == grid.rank and writer != reader:
                            if name not in tensors:  # one tensor per payload, sent to every node lacking it
                                tensors[name] = torch.from_numpy(np.frombuffer(payloads[name], np.uint8).copy())
                            sends.append((writer, tensors[name]))
                            counts["sent_bytes"] += size
                        elif writer == grid.rank and writer != reader:
                            buf = torch.empty(size, dtype=torch.uint8)
                            recvs.append((reader, buf))
                            writes.append((name, buf, sha, i))
                            counts["received_bytes"] += size
                        elif writer == grid.rank:
                            writes.append((name, payloads[name], sha, i))
            comm.exchange(sends, recvs, group=group, caller="staging (read once)")
            t2 = time.perf_counter()
            for name, data, sha, i in writes:
                raw = data.numpy() if isinstance(data, torch.Tensor) else data
                counts["bytes"] += _write(dest, name, raw, sha, splits, _source_id(files[i]))
                counts["files"] += 1
            t3 = time.perf_counter()
            counts["read_s"] += t1 - t0
            counts["exchange_s"] += t2 - t1
            counts["write_s"] += t3 - t2
    comm.barrier(group, caller="staging (read once): written")
    t4 = time.perf_counter()
    # 4. Every node checks what it needs, its ranks sharing the files.
    check_staged(dest, [rel(x) for x in mine[local_rank::len(nodes[me])]], group)
    counts["check_s"] = time.perf_counter() - t4
    return counts


def check_staged(dest: Path, names: Sequence[str], group: Any) -> None:
    """Check ``names`` (paths under ``dest``: this rank's share of its node's files)
    against their records: size and SHA-256. Collective over ``group``: a failure on any
    rank raises ``StagingCheckError`` on every rank, naming the files; the failed files
    and their records are removed, so the next staging fetches them again."""
    bad = []
    for name in names:
        path = dest / name
        try:
            record = json.loads(_record_path(dest, name).read_text(encoding="utf-8"))
            size = path.stat().st_size
            if size != record["size"]:
                bad.append(f"{path}: {size} bytes, the source's {record['size']}")
            elif _sha256_file(path) != record["sha256"]:
                bad.append(f"{path}: SHA-256 differs from the source's ({record['sha256']})")
        except (OSError, ValueError, KeyError) as err:
            bad.append(f"{path}: not staged ({err})")
            continue
        if bad and bad[-1].startswith(f"{path}:"):
            path.unlink(missing_ok=True)
            _record_path(dest, name).unlink(missing_ok=True)
    failures = [x for part in _gather_json(bad, group) for x in part]
    if failures:
        raise StagingCheckError(f"staging check failed for {len(failures)} file(s) (removed: staging again "
                                f"fetches them): " + "; ".join(failures[:10]))
