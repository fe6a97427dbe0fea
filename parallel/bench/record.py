"""Result records: a benchmark's figures as data, with what produced them.

``scripts/benchmark.py SUBCOMMAND ... --record FILE`` appends one JSON line to ``FILE``
for each summary line the benchmark prints:

- ``benchmark`` (the summary's ``command``: ``layer``, ``step``, ``memory --api`` ...),
  ``case`` (the arguments that differ from the subcommand's defaults, by their argparse
  names) and ``args`` (all of them), and ``command``, the command line that reproduces it
  (without ``--record``, ``--out`` and ``--plot``, which say only where output goes);
- ``figures``: the summary's numbers under the summary's names, and ``includes``, the
  benchmark's sentence on what those figures count (where its summary gives one);
- ``date`` (UTC, at the end), ``seconds`` (the whole run), ``git`` (short commit, whether
  the work tree differed from it, and the paths that differed), ``torch`` (version),
  ``machine`` (CPU model, cores, memory, device) and ``load_before``/``load_after`` (the
  1, 5 and 15 minute load averages around the measurement).

``scripts/results_table.py`` reads the committed records (``docs/results/*.jsonl``) and
prints the results table of ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
NOT_MEASURED = ("plot", "out", "record")
"""Arguments that say where output goes, not what is measured: left out of ``case``."""


def git_state(exclude: Path | None = None) -> dict[str, Any]:
    """The repository's short commit and whether its tree differs from it (``exclude``, a
    folder of record files, does not count: writing a record must not make the next dirty)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                              timeout=30).stdout

    try:
        commit = git("rev-parse", "--short=7", "HEAD").strip()
        spec = ["--", "."]
        if exclude is not None and exclude.resolve().is_relative_to(REPO):
            spec.append(f":(exclude){exclude.resolve().relative_to(REPO)}")
        changed = [line[3:] for line in git("status", "--porcelain", *spec).splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": None, "dirty": None, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"commit": commit, "dirty": bool(changed), "changed": changed[:20]}


def machine(device: str = "cpu") -> dict[str, Any]:
    """CPU model, cores, memory and the device the benchmark ran on."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    memory = None
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    out: dict[str, Any] = {"cpu": model, "arch": platform.machine(), "cores": os.cpu_count(),
                           "memory_gib": memory, "device": device}
    simd = [f for f in ("avx512f", "avx2") if f in flags.split()]
    if simd:
        out["simd"] = simd[0]
    if device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
        out["gpus"] = torch.cuda.device_count()
    return out


def case_args(args: argparse.Namespace, defaults: argparse.Namespace) -> dict[str, Any]:
    """The arguments of ``args`` that differ from ``defaults`` (output paths left out)."""
    base = vars(defaults)
    return {k: _plain(v) for k, v in vars(args).items() if k not in NOT_MEASURED and base.get(k) != v}


def _plain(v: Any) -> Any:
    return str(v) if isinstance(v, Path) else v


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's numbers (booleans, load averages and lists left out)."""
    return {k: v for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("load_")}


def make(summary: dict[str, Any], args: argparse.Namespace, defaults: argparse.Namespace, argv: Sequence[str],
         started: float, record_path: Path | None = None) -> dict[str, Any]:
    """One record of ``summary``, printed by ``scripts/benchmark.py`` with ``argv``."""
    import torch

    from parallel.bench.timing import load

    kept, skip = [], False
    for a in argv:  # the command without where its output went
        if skip:
            skip = False
            continue
        if a.startswith("--") and a[2:].replace("-", "_") in NOT_MEASURED:
            skip = True
            continue
        if any(a.startswith(f"--{n}=") for n in NOT_MEASURED):
            continue
        kept.append(a)
    case = case_args(args, defaults)
    case.pop("command", None)
    return {
        "benchmark": summary.get("command", args.command),
        "case": case,
        "args": {k: _plain(v) for k, v in vars(args).items() if k not in NOT_MEASURED},
        "figures": figures(summary),
        "includes": summary.get("includes"),
        "command": "python scripts/benchmark.py " + " ".join(shlex.quote(a) for a in kept),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": round(time.monotonic() - started, 1),
        "git": git_state(record_path.parent if record_path is not None else None),
        "torch": torch.__version__,
        "machine": machine(str(getattr(args, "device", "cpu"))),
        "load_before": summary.get("load_before"),
        "load_after": summary.get("load_after", load()),
    }


def append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


REQUIRED = ("benchmark", "case", "args", "figures", "command", "date", "git", "torch", "machine", "load_before",
            "load_after")


def read(path: Path) -> list[dict[str, Any]]:
    """The records of ``path``; an error naming the file, line and key where one is malformed."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{path}:{n}: record without {', '.join(repr(k) for k in missing)}")
        for key in ("case", "args", "figures", "git", "machine"):
            if not isinstance(rec[key], dict):
                raise ValueError(f"{path}:{n}: {key!r} is {type(rec[key]).__name__}, not an object")
        rec["_where"] = f"{path}:{n}"
        out.append(rec)
    return out
