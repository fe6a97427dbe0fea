"""What a balanced crop needs from a label map, computed once at conversion.

The MLPerf U-Net reference chooses a foreground crop from the label volume itself: the
connected components (6-connectivity, ``scipy.ndimage.label``'s default) of a class, their
bounding boxes (``find_objects``), and the two largest boxes by volume. Storing the boxes
of the ``keep`` largest components of each foreground class lets the training reader make
the same choice without reading a single label voxel (``parallel.data.crops``).

Layout: int32 ``(classes - 1, keep, 7)``; row ``r`` of class ``c`` (label value ``c + 1``)
is ``[d0, d1, h0, h1, w0, w1, component]``, ``[start, stop)`` per dim and the component's
number in ``scipy.ndimage.label``'s raster order; rows are sorted by decreasing box volume
(ties: the later component first), unused rows are -1.
"""

from __future__ import annotations

import numpy as np

from parallel.data.crops import BOX_COLUMNS

KEEP = 8
"""Boxes kept per class: the reference uses the two largest; the rest serve cases smaller
than the crop, whose edge padding can stretch a box touching the border."""


def foreground_boxes(label: np.ndarray, classes: int, keep: int = KEEP) -> np.ndarray:
    """The boxes of the ``keep`` largest components of each class 1..classes-1 of a
    (D, H, W) label map."""
    from scipy import ndimage

    label = np.asarray(label)
    if label.ndim != 3:
        raise ValueError(f"a label map has three dims (D, H, W), got shape {label.shape}")
    out = np.full((classes - 1, keep, BOX_COLUMNS), -1, dtype=np.int32)
    for c in range(1, classes):
        components, n = ndimage.label(label == c)
        if n == 0:
            continue
        boxes = ndimage.find_objects(components)
        volumes = [int(np.prod([s.stop - s.start for s in box])) for box in boxes]
        order = sorted(range(n), key=lambda i: (volumes[i], i), reverse=True)[:keep]
        for row, i in enumerate(order):
            box = boxes[i]
            out[c - 1, row] = [box[0].start, box[0].stop, box[1].start, box[1].stop,
                               box[2].start, box[2].stop, i]
    return out


def box_problems(boxes: np.ndarray, shape: tuple[int, int, int], classes: int) -> list[str]:
    """What is wrong with stored boxes for a case of ``shape`` (empty when they are sound)."""
    boxes = np.asarray(boxes)
    if boxes.ndim != 3 or boxes.shape[0] != classes - 1 or boxes.shape[2] != BOX_COLUMNS:
        return [f"has shape {boxes.shape}, want ({classes - 1}, k, {BOX_COLUMNS})"]
    problems = []
    for c in range(boxes.shape[0]):
        valid = boxes[c, :, 0] >= 0
        if valid.any() and not valid[: int(valid.sum())].all():
            problems.append(f"class {c + 1}: unused (-1) rows before used ones")
        for r in np.flatnonzero(valid):
            row = boxes[c, r]
            for axis, n in enumerate(shape):
                lo, hi = int(row[2 * axis]), int(row[2 * axis + 1])
                if not 0 <= lo < hi <= n:
                    problems.append(f"class {c + 1} box {r}: [{lo}, {hi}) along dim {'DHW'[axis]} "
                                    f"lies outside the case's {n} voxels")
        rows = boxes[c][valid]
        volumes = np.prod(rows[:, 1:6:2] - rows[:, 0:6:2], axis=1) if len(rows) else rows[:, 0]
        if len(rows) > 1 and (np.diff(volumes) > 0).any():
            problems.append(f"class {c + 1}: boxes not sorted by decreasing volume ({volumes.tolist()})")
    return problems
