"""TFRecord files written by hand (the framing and a ``tf.train.Example``), as the MLPerf
HPC CosmoFlow data comes, for the converter tests (tests/unit/test_prepare_cosmoflow.py,
tests/launch/test_prepare_cosmoflow_launch.py)."""

import struct

import numpy as np

from cosmoflow.tfrecord import masked_crc


def tf_record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc(header)) + data + struct.pack("<I", masked_crc(data))


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def example(x: np.ndarray, y: np.ndarray, packed: bool = True) -> bytes:
    """A ``tf.train.Example`` with ``x`` (bytes_list) and ``y`` (float_list), hand-encoded."""
    x_feature = len_field(1, len_field(1, x.astype("<i2").tobytes()))
    if packed:
        floats = len_field(1, y.astype("<f4").tobytes())
    else:
        floats = b"".join(varint(1 << 3 | 5) + struct.pack("<f", v) for v in y)
    y_feature = len_field(2, floats)
    entries = b"".join(len_field(1, len_field(1, k.encode()) + len_field(2, v))
                       for k, v in (("x", x_feature), ("y", y_feature)))
    return len_field(1, entries)
