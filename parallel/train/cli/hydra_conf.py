"""Hydra's own settings for every training entry point, one node per model family.

``register(family)`` (called by ``parallel.train.cli``) stores ``<family>_hydra`` (package
``_global_``), which each ``configs/<family>/*.yaml`` lists in its defaults:

- a single run writes only to ``run.dir`` (Hydra's run directory stays ``.``, so no
  rank creates folders of its own) and saves no ``.hydra/`` copy (``config.yaml`` is in
  ``run.dir``);
- a sweep (``-m``) goes to ``runs/<family>/sweep_<date>/``, each job in ``<job number>/``,
  which becomes the job's ``run.dir``; ``parallel.train.cli.sweep.SweepReport`` reports the
  table of jobs at the end;
- ``--help`` says what the program does, its configs, sections and most used keys;
- the sweep launchers ``spatial_local`` and ``spatial_slurm``
  (``configs/hydra/launcher/*.yaml``, for ``hydra-submitit-launcher``: the ``slurm`` extra)
  start each job's ranks themselves, one spatial group's ranks on a node.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from parallel.job.family import CONFIG_ROOT, Family

# (key, what) of the keys most runs set; every key: --cfg job
COMMON_KEYS = (
    ("data.dir=DIR", "dataset root holding train/ and val/ ({prepare} synthetic --out DIR)"),
    ("parallel.spatial=[sd,sh,sw]", "ways each sample is split along D, H, W (or auto); data axis = world / product"),
    ("train.global_batch_size=N", "samples per optimiser step over all ranks"),
    ("train.epochs=N, train.max_steps=N", "how long to train (the run also stops at the quality target)"),
    ("train.resume=true", "continue the run in run.dir from its last checkpoint"),
    ("train.precision=bf16", "mixed precision (or fp16; fp64 to compare runs exactly)"),
    ("optim.lr=X, optim.name=adamw", "learning rate, optimiser"),
    ("run.dir=DIR", "outputs (default runs/{name}/<date>); a DIR holding a run is refused"),
    ("run.overwrite=true", "start afresh in a run.dir that holds a run (its files move to previous_<k>/)"),
    ("data.max_train_samples=N", "use only the first N training samples"),
)
SECTIONS = "data, parallel, train, optim, sched, eval, run, mlperf, model"


def help_template(family: Family, doc: str | None) -> str:
    """The ``--help`` text of ``python -m <family>.train`` (Hydra adds ``$FLAGS_HELP``)."""
    name = family.name
    what = (doc or f"Train {name} with spatial x data parallelism.").strip().split("\n\n")[0].replace("\n", " ")
    configs = sorted(p.stem for p in (CONFIG_ROOT / name).glob("*.yaml"))
    width = max(len(k) for k, _ in COMMON_KEYS) + 2
    keys = "\n".join(f"  {k.ljust(width)}{v.format(prepare=family.prepare or 'prepare', name=name)}"
                     for k, v in COMMON_KEYS)
    text = f"""python -m {name}.train: {what}

Usage:
  python -m {name}.train [--config-name CONFIG] [KEY=VALUE ...]
  torchrun --nproc-per-node N -m {name}.train ...   |   mpirun -n N python -m {name}.train ...
  python -m {name}.train -m KEY=A,B ...   (a sweep: one run.dir per job under runs/{name}/sweep_<date>/,
                                           the table of jobs in sweep.md / sweep.csv / sweep.jsonl there)

Configs (--config-name, configs/{name}/): {', '.join(configs)}
Config sections: {SECTIONS}   (python -m {name}.train --cfg job prints every key)

Most used keys:
{keys}

Sweep launchers (hydra/launcher=NAME): basic (default: the jobs one after another in
this process), spatial_local and spatial_slurm (each job starts its own ranks; needs the
`slurm` extra: pip install -e .[slurm]).
Exit status: 0 done, 2 bad config or input (one message), 1 a failure while training.
Docs: docs/training.md (configs, outputs, resume, sweeps), docs/failures.md.

== Hydra flags ==
$FLAGS_HELP"""
    return text.replace("${", "\\${")  # no OmegaConf interpolation in the text


def node(family: Family, doc: str | None = None) -> dict[str, Any]:
    """The ``<family>_hydra`` node (package ``_global_``)."""
    name = family.name
    return {"hydra": {
        "run": {"dir": "."},
        "sweep": {"dir": f"runs/{name}/sweep_${{now:%Y-%m-%d_%H-%M-%S}}", "subdir": "${hydra.job.num}"},
        "output_subdir": None,
        "job": {"chdir": False},
        "help": {"app_name": f"{name}.train", "header": "", "footer": "",
                 "template": help_template(family, doc)},
        "callbacks": {"sweep_report": {"_target_": "parallel.train.cli.sweep.SweepReport"}},
    }}


def register(family: Family, doc: str | None = None) -> str:
    """Store the family's Hydra node and the sweep launchers; returns the node's name."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("spatialcnn.group_size"):
        OmegaConf.register_new_resolver("spatialcnn.group_size", group_size)
    store = ConfigStore.instance()
    name = f"{family.name}_hydra"
    store.store(name=name, node=node(family, doc), package="_global_")
    launchers = CONFIG_ROOT / "hydra" / "launcher"
    if _has_submitit():
        import hydra_plugins.hydra_submitit_launcher.config  # noqa: F401 - registers submitit_local/slurm

        for path in sorted(launchers.glob("*.yaml")):
            store.store(group="hydra/launcher", name=path.stem, node=OmegaConf.load(path), package="hydra.launcher")
    return name


def group_size(spatial: Any) -> int:
    """``${spatialcnn.group_size:${parallel.spatial}}``: ranks of one spatial group (the
    sweep launchers' tasks per node)."""
    if isinstance(spatial, str):
        raise ValueError(f"parallel.spatial={spatial}: the sweep launchers need the split itself "
                         "([sd,sh,sw]), or set hydra.launcher.tasks_per_node")
    size = 1
    for s in spatial:
        size *= int(s)
    return size


def _has_submitit() -> bool:
    try:
        import hydra_plugins.hydra_submitit_launcher  # noqa: F401
    except ImportError:
        return False
    return True


def entry_doc() -> str | None:
    """The docstring of the running ``python -m`` module (the entry point's own words)."""
    main = sys.modules.get("__main__")
    return getattr(main, "__doc__", None) if main is not None and Path(str(getattr(main, "__file__", ""))).stem == \
        "train" else None
