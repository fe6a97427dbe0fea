"""Measure the framework on this machine: halo overhead, step time, memory, I/O, loading.

Every subcommand prints JSON lines (one object per measurement, then one ``summary``
object with the ratios the targets are stated in) and, with ``--plot DIR`` and matplotlib
installed (``pip install -e .[bench]``), a PNG where a curve says more than a table.
Ranks are spawned here with gloo on localhost, one thread each; timings are medians of
interleaved trials, so the load of other processes hits both sides of a ratio alike.

    python scripts/benchmark.py layer            # halo overhead of a split conv (64^3 x 32ch)
    python scripts/benchmark.py step             # CosmoFlow / U-Net step time per grid
    python scripts/benchmark.py memory           # peak memory per rank per grid vs serial
    python scripts/benchmark.py io               # bytes and MB/s: block vs whole vs raw read
    python scripts/benchmark.py loader           # share of the step spent waiting for data
    python scripts/benchmark.py wall             # time per epoch vs ranks through a shared storage bandwidth
    python scripts/benchmark.py calibrate        # measure this machine for parallel.plan
    python scripts/benchmark.py peers --quick    # split layers vs block conv vs ShardTensor, DistConv

Each runs in under 5 minutes on 2 cores with its defaults; ``--help`` on a subcommand
lists its sizes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank, before torch loads

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.bench import commands, record  # noqa: E402


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_ranks, which kills the spawned ranks


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in commands.COMMANDS.items():
        sp = sub.add_parser(name, help=commands.COMMANDS[name][1].__doc__.splitlines()[0])
        add_args(sp)
        sp.add_argument("--plot", type=Path, default=None, help="write PNG plots here (needs matplotlib)")
        sp.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
        sp.add_argument("--record", type=Path, default=None,
                        help="append a result record (the summary's figures, the command, date, git commit, torch, "
                             "machine, load averages) to this JSONL file, e.g. docs/results/<benchmark>.jsonl")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    started = time.monotonic()
    _, run = commands.COMMANDS[args.command]
    recorded = False
    for row in run(args):
        line = json.dumps(row)
        print(line, flush=True)
        for text in row.get("table", ()):  # a table for people, beside the JSON for programs
            print(text, file=sys.stderr, flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        if args.record is not None and row.get("kind") == "summary":
            defaults = p.parse_args([args.command])
            record.append(args.record, record.make(row, args, defaults, argv, started, args.record))
            recorded = True
    if args.record is not None and not recorded:
        print(f"--record {args.record}: {args.command} prints no summary line; nothing recorded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
