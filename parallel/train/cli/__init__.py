"""The command line of every family's ``python -m <family>.train`` (Hydra).

- ``main``: ``main(family)`` composes the config from ``configs/<family>/`` and the
  command line, then trains (one run, or each job of a sweep); ``register`` stores the
  family's schema and Hydra settings;
- ``hydra_conf``: Hydra's own settings (output directories off, the sweep directory,
  ``--help``, the sweep launchers);
- ``sweep``: Hydra sweeps (``-m``): each job its ``run.dir``, a table of jobs.
"""

from parallel.job.family import CONFIG_ROOT
from parallel.job.from_hydra import load_job
from parallel.train.cli.main import main, register

__all__ = ["CONFIG_ROOT", "load_job", "main", "register"]
