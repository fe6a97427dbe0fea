"""What the subcommands of ``scripts/benchmark.py`` share: their rows, size arguments,
per-family model overrides and optional PNG plots."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Iterator

from parallel.job.family import get

Rows = Iterator[dict[str, Any]]


def sizes(text: str) -> list[int]:
    """``64`` -> [64, 64, 64]; ``32x64x64`` -> [32, 64, 64]."""
    return [int(v) for v in text.split("x")] if "x" in text else [int(text)] * 3


def overrides_of(args: argparse.Namespace, name: str) -> list[str]:
    """The ``--<family>-set`` overrides of a family, else the family's benchmark defaults."""
    given = getattr(args, f"{name.replace('-', '_')}_set", None)
    return list(given) if given is not None else list(get(name).bench_overrides)


def plot(args: argparse.Namespace, name: str, draw: Callable[[Any], None]) -> str | None:
    """A PNG under ``--plot`` if matplotlib is installed; its path, or None."""
    if args.plot is None:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    args.plot.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    draw(ax)
    fig.tight_layout()
    path = args.plot / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)



def agree(ok: bool, group: object) -> bool:
    """Whether every rank of ``group`` says ``ok`` (a peer is dropped on all ranks or none)."""
    import torch

    from parallel import comm

    t = torch.tensor([0.0 if ok else 1.0])
    comm.all_reduce_(t, group, "max", caller="bench.agree")
    return t.item() == 0.0


def failure(e: BaseException) -> str:
    """A peer's failure in one line for its row: ``failed: Type: first line of the message``."""
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"failed: {type(e).__name__}: {first}"
