#!/usr/bin/env python3
"""Run every shell command of README.md and docs/*.md as written, at a small size.

    python scripts/check_docs.py              # the CI subset (tests/launch/test_docs_commands.py, ~2 min on 2 cores)
    python scripts/check_docs.py --all        # every command that can run here (trainings to the target,
                                              # benchmarks, submissions: an hour or more on 2 cores)
    python scripts/check_docs.py --list       # each command, where it is, its rule: ci, all or skip (why)
    python scripts/check_docs.py -k selfcheck # only commands containing this text (with --all: any tier)

Commands are the lines of fenced ``bash``/``sh``/``shell`` blocks and of indented blocks
that start like a command (``python``, ``torchrun``, ``mpirun``, ``srun``, ``bash``,
``scripts/``, ``VAR=value ...``); a line ending in ``\\`` continues on the next, and a
``# comment`` is dropped. Each runs in a scratch folder (``--workdir``, default a new
temporary one) that links the repository's code, so ``data/`` and ``runs/`` are its
own: the datasets the commands name (``data/cosmo``, ``data/kits``, ...) are generated
there first at a small size (``FIXTURES``). ``RULES`` says, for each command, what makes
it small (replacements, appended Hydra overrides, environment; Slurm's ``srun`` and
``sbatch`` are the stand-ins of ``tests/support/slurm``) or why it cannot run here. A command
that no rule matches is an error (exit 2): add a rule beside the others.

Exit status: 0 every selected command passed; 1 one failed (its command, where it is
written, and the tail of its output are printed); 2 a command without a rule.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/*.md")
LINKED = ("configs", "cosmoflow", "unet3d", "parallel", "scripts", "tests", "docs", "README.md", "pyproject.toml")
COMMAND = re.compile(r"^(python3?|torchrun|mpirun|mpiexec|srun|sbatch|bash|scripts/|[A-Z_][A-Z0-9_]*=\S*\s)")

COSMO_SMALL = "train.max_steps=2 train.global_batch_size=4 model.conv_filters=4 sched.warmup_epochs=0 run.progress=false"
UNET_SMALL = ("train.max_steps=2 train.global_batch_size=2 model.base_filters=4 model.max_filters=16 "
              "data.crop=[32,32,32] model.depth=3 run.progress=false")
QUICK = "train.max_steps=2 run.progress=false"

# name -> (model, size, train, val): generated in the scratch folder before a command needs them
FIXTURES = {
    "data/cosmo": ("cosmoflow", 64, 4, 2),
    "data/cosmo32": ("cosmoflow", 32, 4, 2),
    "data/kits": ("unet3d", 32, 2, 2),
}


@dataclass
class Rule:
    """What to do with the commands ``pattern`` matches (``re.search`` on the command)."""

    pattern: str
    tier: str
    """``ci`` (every check), ``all`` (``--all`` only) or ``skip``."""
    why: str = ""
    """For ``skip``: why it cannot run here; else what the small size changes."""
    sub: tuple[tuple[str, str], ...] = ()
    """(regex, replacement) applied in turn to the command text."""
    append: str = ""
    """Appended to the command (Hydra overrides after the last argument)."""
    env: dict[str, str] = field(default_factory=dict)
    slurm: bool = False
    """Put the Slurm stand-ins (tests/support/slurm) first on PATH."""
    timeout: float = 600


RULES = [
    # -- set-up and the test suite: they would reinstall into, or run, what is checking them
    Rule(r"scripts/setup\.sh", "skip", "installs into the environment the checker runs in"),
    Rule(r"scripts/test\.sh", "skip", "the test suite, which runs this checker"),
    Rule(r"scripts/check_docs\.py", "skip", "this checker"),
    Rule(r"gpu_check\.sh\s*(#|$)", "skip", "needs GPUs (scripts/gpu_check.sh --cpu is its dry run)"),
    Rule(r"gpu_check\.sh --cpu", "all", "tiny sizes on the CPU; tests/launch/test_gpu_check.py runs it too",
         timeout=1800),
    # -- data
    Rule(r"\.prepare synthetic .*--out data/kits_like","all", "12 cases of 40..48 voxels",
         sub=((r"--out data/kits_like", "--out prepared/kits_like"), (r"--size-range 40,64", "--size-range 40,48")),
         append="--train 8 --val 4"),
    Rule(r"cosmoflow\.prepare synthetic ", "ci", "4 train / 2 val samples of 16^3 into prepared/",
         sub=((r"--out data/", "--out prepared/"), (r"--size \d+", "--size 16"), (r"--train \d+", "--train 4"),
              (r"--val \d+", "--val 2"))),
    Rule(r"\.prepare synthetic ", "all", "4 train / 2 val samples of 16^3 into prepared/",
         sub=((r"--out data/", "--out prepared/"), (r"--size \d+", "--size 16"), (r"--train \d+", "--train 4"),
              (r"--val \d+", "--val 2"))),
    Rule(r"\.prepare (from-npy|from-kits) SRC OUT", "skip",
         "placeholders SRC OUT; tests/unit/test_prepare_cosmoflow.py and test_prepare_unet3d.py convert made sources"),
    Rule(r"benchmark_io\.py","all", "16^3 volumes", sub=((r"--size \d+", "--size 16"),)),
    # -- self-checks
    Rule(r"^python -m parallel\.selfcheck", "ci"),
    Rule(r"^torchrun .*parallel\.selfcheck","all"),
    Rule(r"^mpirun .*parallel\.selfcheck", "all"),
    Rule(r"^srun .*parallel\.selfcheck", "all", "the Slurm stand-in (tests/support/slurm/srun)", slurm=True),
    # -- training
    Rule(r"train\.profile=", "all", "2 steps on data/cosmo32 (a trace of 1)",
         append="data.dir=data/cosmo32 train.max_steps=2 train.global_batch_size=4 run.progress=false"),
    Rule(r"^python scripts/trace_png\.py", "all", "draws the train.profile run above, into the scratch folder",
         sub=((r"--out \S+", "--out trace.png"),)),
    Rule(r"train\.compile=", "all", "steps on data/cosmo32, Inductor's first C++ build included", timeout=1800,
         append="data.dir=data/cosmo32 train.max_steps=4 train.global_batch_size=4 run.progress=false"),
    Rule(r"hydra/launcher=spatial_local", "all", "2 jobs of 2 ranks, 2 steps each", append=COSMO_SMALL),
    Rule(r"^python -m cosmoflow\.train -m ", "ci", "a 2-job sweep of 2 steps", append=COSMO_SMALL),
    Rule(r"^python -m cosmoflow\.train \.\.\. parallel\.spatial=auto","all", "'...' is data.dir=data/cosmo32",
         sub=((r"\.\.\.", "data.dir=data/cosmo32"),), append=COSMO_SMALL),
    Rule(r"^python -m cosmoflow\.train --config-name quickstart","all", "2 steps", append=QUICK),
    Rule(r"^python -m cosmoflow\.train ", "ci", "2 steps of a 4-filter network", append=COSMO_SMALL),
    Rule(r"^torchrun --nnodes=2:4 ", "skip",
         "an elastic job of 2-4 nodes; tests/launch/test_elastic.py runs 2 agents here"),
    Rule(r"elastic_slurm\.sh", "ci", "DRY_RUN=1: prints the srun step"),
    # a MONAI network's strides need blocks of 16 voxels at 2x1x1: the 32^3 set, not prepared/'s 16^3
    Rule(r"torchrun .*-m cosmoflow\.train --config-name quickstart .*model\._target_=monai\.", "all",
         "2 steps of the MONAI network on data/cosmo32 (32^3, batch 4)",
         sub=((r"--config-name quickstart", "--config-name quickstart data.dir=data/cosmo32"),),
         append="train.max_steps=2 train.global_batch_size=4 run.progress=false"),
    Rule(r"torchrun .*-m cosmoflow\.train --config-name quickstart", "all", "2 steps", append=QUICK),
    Rule(r"torchrun .*-m cosmoflow\.train ", "all", "2 steps of a 4-filter network", append=COSMO_SMALL),
    Rule(r"-m unet3d\.train .*model\._target_=monai\.", "all", "2 steps of the MONAI network on 32^3 crops of data/kits",
         sub=((r"--config-name quickstart", "--config-name quickstart data.dir=data/kits"),),
         append="train.max_steps=2 train.global_batch_size=2 data.crop=[32,32,32] run.progress=false"),
    Rule(r"^python -m unet3d\.predict --run-dir runs/kits ", "all",
         "the README's mpirun run above (2 steps) segments data/kits's val cases"),
    Rule(r"^mpirun -n 4 python -m unet3d\.train ", "ci",
         "2 steps of a 3-level U-Net on 32^3 crops, on 2 ranks split along D (4 ranks under mpirun: "
         "tests/launch/test_launchers.py)",
         sub=((r"^mpirun -n 4 ", "mpirun -n 2 "), (r"parallel\.spatial=\[\d,\d,\d\]", "parallel.spatial=[2,1,1]")),
         append=UNET_SMALL),
    Rule(r"^mpirun -n 8 python -m unet3d\.train ", "all", "2 steps of a 3-level U-Net on data/kits",
         sub=((r"data\.dir=/data/kits", "data.dir=data/kits"),), append=UNET_SMALL),
    Rule(r"^srun -N 4 --ntasks-per-node 4 .*mlperf512", "skip",
         "16 ranks of the 512^3 network on 4 nodes: a cluster's job"),
    Rule(r"^scripts/launch\.sh ", "all", "2 steps of a 4-filter network", append=COSMO_SMALL),
    Rule(r"quickstart\.sh", "all", "trains to the MLPerf target as written (minutes)", timeout=1800),
    Rule(r"\.predict --run-dir RUN", "skip",
         "placeholders RUN, DIR; tests/launch/test_predict.py runs both predict CLIs"),
    # -- clusters and submissions
    Rule(r"submit\.sh --system h200x8", "ci", "--dry-run: prints the sbatch command for the 16-node system",
         sub=((r"--system h200x8", "--system h200x8 --dry-run"),)),
    Rule(r"submit\.sh --system local", "all", "trainings to the target as written (minutes)", slurm=True,
         timeout=3600),
    Rule(r"sbatch -N 16 .*scripts/run\.sub", "skip", "16 nodes of 8 GPUs (submit.sh --dry-run above shows the call)"),
    Rule(r"collect_results\.py", "skip",
         "needs a submission's logs (tests/launch/test_cluster_scripts.py collects one)"),
    # -- performance
    Rule(r"^python -m parallel\.data stage ", "all", "stages data/cosmo (its train and val) into the scratch folder"),
    Rule(r"^python -m parallel\.plan\.target ", "all", "as written: writes runs/target.json in the scratch folder"),
    Rule(r"^python -m parallel\.plan .*--target ", "all", "as written, after the parallel.plan.target command above"),
    Rule(r"^python -m parallel\.plan .*--alpha", "all", "the same tool as README's plan command, which CI runs"),
    Rule(r"^python -m parallel\.plan .*--fs-bandwidth", "all",
         "the same tool as README's plan command, which CI runs; tests/unit/test_plan_io.py checks its wait"),
    Rule(r"^python -m parallel\.plan ", "ci"),
    Rule(r"peers-venv", "skip", "installs the peers (not dependencies) from the registry into a scratch "
         "environment; the peers command above runs without them (--all)"),
    Rule(r"^PYTHONPATH=\.:peers/DistConv python scripts/benchmark\.py peers ", "skip",
         "needs LBANN DistConv from a checkout in peers/ (not a dependency; the registry has no copy)"),
    Rule(r"^python scripts/benchmark\.py peers$", "skip", "the full peers set takes hours on 2 cores (--quick runs)"),
    Rule(r"^python scripts/benchmark\.py ", "all", "as written (minutes each)", timeout=3600),
    Rule(r"^python scripts/compare_optim\.py ", "all", "as written: the sweep and the 12 runs take 15-30 minutes each",
         timeout=3600),
    Rule(r"^python scripts/kfac_lowrank\.py ", "all", "as written: minutes each (dense eigendecompositions up to 6913 wide)",
         timeout=3600),
    Rule(r"^python scripts/kfac_blocks\.py ", "all", "as written: CosmoFlow's head at 128^3 on 1, 2 and 4 ranks, "
         "minutes (eigendecompositions 4096 wide)", timeout=3600),
    Rule(r"^python scripts/kfac_cheap\.py ", "all", "as written: minutes each (20 steps with six optimisers)",
         timeout=3600),
    Rule(r"scripts/perf_pass\.sh", "all", "the whole pass as written (about 17 minutes)", timeout=3600),
    Rule(r"^python scripts/memory_demo\.py --size 128", "all", "as written: 128^3, a few minutes", timeout=1800),
    Rule(r"^python scripts/memory_demo\.py", "all", "as written: 256^3 on 4 ranks, about 10 minutes", timeout=3600),
    Rule(r"^python scripts/plan_report\.py ", "all", "as written: the planner's tables (half a minute each)"),
    Rule(r"^python scripts/results_table\.py --write", "skip",
         "rewrites the doc from the records; --check, which runs, compares the same table"),
    Rule(r"^python scripts/results_table\.py --check", "ci", "compares docs/performance.md's table with docs/results"),
]


@dataclass
class Command:
    text: str
    where: str
    rule: Rule | None = None


def extract(path: Path) -> list[Command]:
    """The commands written in ``path`` (see the module docstring)."""
    out: list[Command] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    fence: str | None = None
    pending, start = "", 0
    for i, line in enumerate(lines, 1):
        m = re.match(r"^\s*```(\w*)", line)
        if m:
            fence = None if fence is not None else m.group(1)
            continue
        if fence is not None:
            body = line.strip() if fence in ("bash", "sh", "shell") else ""
        elif line.startswith("    ") and (pending or COMMAND.match(line.strip())):
            body = line.strip()
        else:
            body = ""
        if not body and not pending:
            continue
        if not pending:
            start = i
        body = _drop_comment(body)
        if body.endswith("\\"):
            pending += body[:-1].rstrip() + " "
            continue
        text = (pending + body).strip()
        pending = ""
        if text:
            out.append(Command(text, f"{path.relative_to(REPO)}:{start}"))
    return out


def _drop_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` inside quotes stays)."""
    quote = None
    for j, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (j == 0 or line[j - 1].isspace()):
            return line[:j].rstrip()
    return line.rstrip()


def commands() -> list[Command]:
    """Every command of the docs, each with its rule (None: no rule matches)."""
    found = []
    for pattern in DOCS:
        for path in sorted(REPO.glob(pattern)):
            for cmd in extract(path):
                cmd.rule = next((r for r in RULES if re.search(r.pattern, cmd.text)), None)
                found.append(cmd)
    return found


def small(cmd: Command) -> str:
    """The command as it runs here: the rule's replacements and appended overrides."""
    assert cmd.rule is not None
    text = cmd.text
    for pattern, repl in cmd.rule.sub:
        text = re.sub(pattern, repl, text)
    return f"{text} {cmd.rule.append}".strip()


def scratch(workdir: Path) -> Path:
    """A folder that links the repository's code; commands write their data/ and runs/ there."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = workdir / name
        if not link.exists():
            link.symlink_to(REPO / name)
    return workdir


def fixtures(workdir: Path, text: str, env: dict[str, str]) -> None:
    """Generate the small datasets ``text`` names that are not there yet."""
    for name, (model, size, n_train, n_val) in FIXTURES.items():
        if re.search(rf"(?<![\w/]){re.escape(name)}(?![\w])", text) and not (workdir / name / "val").is_dir():
            subprocess.run([sys.executable, "-m", f"{model}.prepare", "synthetic", "--out", name, "--size", str(size),
                            "--train", str(n_train), "--val", str(n_val), "--seed", "0", "--quiet"],
                           cwd=workdir, env=env, check=True, capture_output=True, timeout=600)


def run(cmd: Command, workdir: Path) -> tuple[bool, float, str]:
    """Run one command in ``workdir``; (passed, seconds, output tail)."""
    assert cmd.rule is not None
    env = dict(os.environ, OMP_NUM_THREADS="1", SPATIALCNN_SKIP_SETUP="1", **cmd.rule.env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this environment's python, torchrun
    if cmd.rule.slurm:
        env["PATH"] = f"{REPO / 'tests' / 'support' / 'slurm'}{os.pathsep}{env['PATH']}"
    text = small(cmd)
    fixtures(workdir, text, env)
    t0 = time.monotonic()
    # its own session: a timeout ends every process the command started, launchers' ranks included
    proc = subprocess.Popen(["bash", "-c", f"set -eo pipefail; {text}"], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=cmd.rule.timeout)
        ok, out = proc.returncode == 0, f"exit {proc.returncode}\n{out}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        ok, out = False, f"timed out after {cmd.rule.timeout:.0f} s\n{out}"
    return ok, time.monotonic() - t0, out[-4000:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="also the commands of tier 'all' (long)")
    ap.add_argument("--list", action="store_true", help="list the commands and their rules; run nothing")
    ap.add_argument("-k", default="", help="only commands containing this text")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    args = ap.parse_args(argv)
    found = [c for c in commands() if args.k in c.text]
    unruled = [c for c in found if c.rule is None]
    for c in unruled:
        print(f"NO RULE {c.where}: {c.text}\n  add a Rule to scripts/check_docs.py RULES: run it small or say why "
              "it cannot run here")
    if args.list:
        for c in found:
            r = c.rule
            what = "-" if r is None else (f"{r.tier}: {r.why}" if r.why else r.tier)
            print(f"{c.where:24} {what}\n    {c.text}" + (f"\n    runs as: {small(c)}" if r and r.tier != "skip"
                                                             and small(c) != c.text else ""))
        return 2 if unruled else 0
    tiers = ("ci", "all") if args.all or args.k else ("ci",)
    todo = [c for c in found if c.rule is not None and c.rule.tier in tiers]
    workdir = scratch(args.workdir or Path(tempfile.mkdtemp(prefix="check_docs_")))
    print(f"check_docs: {len(todo)} of {len(found)} commands ({', '.join(tiers)}) in {workdir}", flush=True)
    failed = []
    done: dict[str, tuple[bool, float, str]] = {}  # a command written twice runs once
    for c in todo:
        ok, seconds, out = done[small(c)] if small(c) in done else run(c, workdir)
        done[small(c)] = (ok, 0.0, out)
        print(f"{'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {c.where}: {c.text}", flush=True)
        if not ok:
            failed.append(c)
            print(f"  ran as: {small(c)}\n  " + "\n  ".join(out.splitlines()[-25:]), flush=True)
    skipped = sum(1 for c in found if c.rule is not None and c.rule.tier not in tiers)
    print(f"check_docs: {len(todo) - len(failed)} passed, {len(failed)} failed, {skipped} not run here "
          f"(--list says why), {len(unruled)} without a rule")
    if unruled:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
