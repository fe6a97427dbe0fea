"""``python scripts/benchmark.py ARGS`` for the tests, run in the test's own process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def benchmark(*args: str) -> subprocess.CompletedProcess:
    """``python scripts/benchmark.py ARGS`` run as ``__main__`` in this process: its ranks
    are still new processes (forked from this process's fork server, or spawned where the
    subcommand asks), but the script's own interpreter and fork server start once per test
    worker instead of ~6 CPU-s per command. What needs the script as its own process (its
    SIGTERM) starts it for real: ``test_sigterm_stops_the_spawned_ranks_too``."""
    import contextlib
    import io
    import runpy
    import signal

    out, err = io.StringIO(), io.StringIO()
    argv, path, cwd, on_term = sys.argv, list(sys.path), os.getcwd(), signal.getsignal(signal.SIGTERM)
    sys.argv = [str(ROOT / "scripts" / "benchmark.py"), *args]
    code: object = None
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(sys.argv[0], run_name="__main__")  # runpy puts __main__ back itself
    except SystemExit as exc:
        code = exc.code
    finally:  # what the script changes in its process: argv, sys.path, the directory, its SIGTERM handler
        sys.argv, sys.path[:] = argv, path
        os.chdir(cwd)
        signal.signal(signal.SIGTERM, on_term)
    if code is not None and not isinstance(code, int):  # sys.exit("message"): what python prints, status 1
        err.write(f"{code}\n")
        code = 1
    return subprocess.CompletedProcess(["benchmark.py", *args], code or 0, out.getvalue(), err.getvalue())
