"""The Hydra entry point behind each family's ``python -m <family>.train``.

The family's ``JobConfig`` subclass is registered as the structured config
``<family>_schema``; YAML files in ``configs/<family>/`` start from it and hold overrides
only (``--config-name quickstart``), and every field can be overridden on the command
line. Hydra's own settings (``parallel.train.cli.hydra_conf``: its logging and output
directory off, the sweep directory, ``--help``) come with ``<family>_hydra``: the run
writes its outputs (and the resolved ``config.yaml``) to ``run.dir``; a sweep (``-m``)
gives each job its own (``parallel.train.cli.sweep``).

Config errors, Hydra's own included (an unknown key, an ill-typed value), end the
process with status 2 and one message, from rank 0 only (``docs/failures.md``).
With ``model._target_=...`` on the command line the model section is that network's keyword
arguments instead of the family's typed section (``parallel.job.usermodel``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import sys
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from parallel.job import usermodel
from parallel.job.family import CONFIG_ROOT, Family
from parallel.job.from_hydra import UnknownKeyError, to_dataclass
from parallel.runtime.launch import env_rank

__all__ = ["main", "register"]

log = logging.getLogger("parallel.train")
_STORED: dict[str, tuple[type, str | None]] = {}  # schema name -> (class, doc) stored with Hydra


def register(family: Family, doc: str | None = None) -> str:
    """Register the family's schema and its Hydra settings (``<family>_hydra``: output
    directories, sweeps, ``--help`` from ``doc``) with Hydra; returns the schema's name."""
    from parallel.train.cli import hydra_conf

    name = f"{family.name}_schema"
    if _STORED.get(name) != (family.config_class, doc):  # once per process (a job pool's worker runs many)
        ConfigStore.instance().store(name=name, node=family.config_class)
        hydra_conf.register(family, doc)
        _STORED[name] = (family.config_class, doc)
    return name


def main(family: Family, config_name: str = "default") -> Any:
    """Compose the config from ``configs/<family>/`` and the command line, then train
    (one run, or each job of a sweep)."""
    from parallel.train.cli import hydra_conf, sweep

    user_model, argv, model_keys = usermodel.prepare_argv(sys.argv[1:])
    if user_model:  # model._target_=...: the model section is that network's arguments
        family = dataclasses.replace(family, config_class=usermodel.job_class(family.config_class))
        sys.argv[1:] = argv
    register(family, hydra_conf.entry_doc())
    stderr = sys.stderr
    entered = False

    @hydra.main(version_base=None, config_path=str(CONFIG_ROOT / family.name), config_name=config_name)
    def _run(cfg: DictConfig) -> Any:
        from parallel.train.lifecycle import train

        nonlocal entered
        entered = True
        sys.stderr = stderr
        job_info = sweep.current_job()
        if job_info is not None:
            sweep.submitit_env()
            sweep.adopt_run_dir(cfg, job_info)
        if user_model:
            dropped = usermodel.keep_command_line(cfg, model_keys)
            if dropped and env_rank() == 0:
                log.warning("model._target_=%s: the config file's model keys %s (the %s network's) are left out",
                            cfg.model[usermodel.TARGET], ", ".join(dropped), family.name)
        try:
            job = to_dataclass(cfg, family.config_class)
        except (UnknownKeyError, ValidationError) as err:  # one clean line, like Hydra's own override errors
            if env_rank() == 0:
                print(f"bad config: {err}", file=sys.stderr)
            if job_info is None:
                raise SystemExit(2) from None
            return sweep.run_job(lambda e=err: _refuse(e), job_info, lambda: str(cfg.run.dir))
        text = OmegaConf.to_yaml(cfg, resolve=True)
        if job_info is None:
            return train(job, family, text)
        return sweep.run_job(lambda: train(job, family, text), job_info, lambda: job.run.dir)

    if env_rank() != 0:  # every rank composes the same config: only rank 0 reports its errors
        sys.stderr = io.StringIO()
    try:
        result = _run()
    except SystemExit as exc:
        if not entered and exc.code == 1:  # Hydra's own config errors (unknown key, ill-typed value)
            raise SystemExit(2) from None
        raise
    finally:
        sys.stderr = stderr
    if sweep.FAILED:
        raise SystemExit(1)
    return result


def _refuse(err: Exception) -> Any:
    raise SystemExit(2) from err
