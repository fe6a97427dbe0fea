"""The subcommands of ``scripts/benchmark.py``: each adds its arguments and yields JSON rows."""

from __future__ import annotations

import argparse
from typing import Callable

from parallel.bench import calibrate, grids, peers, reads, wall
from parallel.bench.shared import Rows

COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Rows]]] = {
    "layer": (grids.layer_args, grids.layer),
    "step": (grids.step_args, grids.step),
    "memory": (grids.memory_args, grids.memory),
    "io": (reads.io_args, reads.io),
    "loader": (reads.loader_args, reads.loader),
    "calibrate": (calibrate.command_args, calibrate.command),
    "peers": (peers.command_args, peers.command),
    "wall": (wall.wall_args, wall.wall),
}
