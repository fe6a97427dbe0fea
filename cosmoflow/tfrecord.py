"""Reading TFRecord files without TensorFlow: the record framing and ``tf.train.Example``.

A TFRecord file (optionally gzip-compressed as a whole) is a sequence of records::

    uint64 length (little-endian) | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

and each record of the CosmoFlow data is a serialised ``Example``:
``Example{features=1: Features{feature=1: map<string, Feature>}}`` with
``Feature{bytes_list=1 | float_list=2 | int64_list=3}``, each list holding field 1.
Both CRCs of every record are verified (CRC-32C from the ``google-crc32c`` package, a
dependency: its C implementation checks a 16 MB record in milliseconds), so a corrupt
record is refused, naming the file and the record.
"""

from __future__ import annotations

import gzip
import logging
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import google_crc32c
import numpy as np

log = logging.getLogger(__name__)

if google_crc32c.implementation != "c":  # a wheel without the C extension on this platform
    log.warning("google-crc32c runs in pure Python here: checking large TFRecord files will be slow")


class TFRecordError(ValueError):
    """A TFRecord file is truncated or corrupt; the message names the file and record."""


def crc32c(data: bytes | memoryview) -> int:
    """The CRC-32C (Castagnoli) of ``data``."""
    return int(google_crc32c.value(bytes(data)))


def masked_crc(data: bytes | memoryview) -> int:
    """The TFRecord checksum of ``data``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _open(path: Path) -> BinaryIO:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")  # type: ignore[return-value]


def read_records(path: str | Path) -> Iterator[bytes]:
    """The records of a TFRecord file, gzip-compressed or plain (detected by magic); each
    record's length and data checked against their CRCs."""
    path = Path(path)
    with _open(path) as fh:
        index = 0
        while True:
            try:
                header = fh.read(12)
            except (OSError, EOFError) as err:
                raise TFRecordError(f"{path}: record {index}: cannot read ({err})") from err
            if not header:
                return
            if len(header) < 12:
                raise TFRecordError(f"{path}: record {index}: truncated header ({len(header)} of 12 bytes)")
            length, length_crc = struct.unpack("<QI", header)
            if masked_crc(header[:8]) != length_crc:
                raise TFRecordError(f"{path}: record {index}: length CRC mismatch (corrupt framing)")
            try:
                data = fh.read(length)
                footer = fh.read(4)
            except (OSError, EOFError) as err:
                raise TFRecordError(f"{path}: record {index}: cannot read ({err})") from err
            if len(data) < length or len(footer) < 4:
                raise TFRecordError(f"{path}: record {index}: truncated ({len(data)} of {length} bytes)")
            if masked_crc(data) != struct.unpack("<I", footer)[0]:
                raise TFRecordError(f"{path}: record {index}: data CRC mismatch ({length} bytes; the file is "
                                    "corrupt)")
            yield data
            index += 1


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise TFRecordError("varint runs past the end of the message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message; LEN values as memoryviews."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise TFRecordError(f"field {number}: {n} bytes run past the end of the message")
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise TFRecordError(f"field {number}: unsupported wire type {wire}")
        yield number, wire, value


def _feature(buf: memoryview) -> tuple[str, Any]:
    for number, _, value in _fields(buf):
        if number == 1:  # BytesList
            return "bytes", [bytes(v) for n, w, v in _fields(value) if n == 1]
        if number == 2:  # FloatList: packed (LEN) or one fixed32 per value
            parts = [np.frombuffer(v, dtype="<f4") for n, w, v in _fields(value) if n == 1]
            return "float", np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if number == 3:  # Int64List: packed or one varint per value
            ints: list[int] = []
            for n, w, v in _fields(value):
                if n != 1:
                    continue
                if w == 0:
                    ints.append(v)
                else:
                    pos = 0
                    while pos < len(v):
                        x, pos = _varint(v, pos)
                        ints.append(x)
            return "int64", np.asarray([(x - (1 << 64)) if x >> 63 else x for x in ints], dtype=np.int64)
    return "empty", []


def parse_example(record: bytes) -> dict[str, tuple[str, Any]]:
    """``{name: (kind, values)}`` of a serialised ``tf.train.Example``."""
    out: dict[str, tuple[str, Any]] = {}
    for number, _, features in _fields(memoryview(record)):
        if number != 1:
            continue
        for n, _, entry in _fields(features):
            if n != 1:
                continue
            key, value = None, None
            for m, _, v in _fields(entry):
                if m == 1:
                    key = bytes(v).decode("utf-8")
                elif m == 2:
                    value = v
            if key is not None:
                out[key] = _feature(value if value is not None else memoryview(b""))
    return out
