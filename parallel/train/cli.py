"""The Hydra entry point behind each family's ``python -m <family>.train``.

The family's ``JobConfig`` subclass is registered as the structured config
``<family>_schema``; YAML files in ``configs/<family>/`` start from it and hold overrides
only (``--config-name quickstart``), and every field can be overridden on the command
line. Hydra's own logging and output directory are switched off in those files: the
run writes its outputs (and the resolved ``config.yaml``) to ``run.dir``. With
``model._target_=...`` on the command line the model section is that network's keyword
arguments instead of the family's typed section (``parallel.train.usermodel``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from parallel.launch import env_rank
from parallel.train import usermodel
from parallel.train.config import UnknownKeyError, to_dataclass
from parallel.train.family import CONFIG_ROOT, Family

__all__ = ["CONFIG_ROOT", "load_job", "main", "register"]

log = logging.getLogger("parallel.train")


def register(family: Family) -> str:
    """Register the family's schema with Hydra; returns its name."""
    name = f"{family.name}_schema"
    ConfigStore.instance().store(name=name, node=family.config_class)
    return name


def main(family: Family, config_name: str = "default") -> Any:
    """Compose the config from ``configs/<family>/`` and the command line, then train."""
    user_model, argv, model_keys = usermodel.prepare_argv(sys.argv[1:])
    if user_model:  # model._target_=...: the model section is that network's arguments
        family = dataclasses.replace(family, config_class=usermodel.job_class(family.config_class))
        sys.argv[1:] = argv
    register(family)

    @hydra.main(version_base=None, config_path=str(CONFIG_ROOT / family.name), config_name=config_name)
    def _run(cfg: DictConfig) -> Any:
        from parallel.train.lifecycle import train

        if user_model:
            dropped = usermodel.keep_command_line(cfg, model_keys)
            if dropped and env_rank() == 0:
                log.warning("model._target_=%s: the config file's model keys %s (the %s network's) are left out",
                            cfg.model[usermodel.TARGET], ", ".join(dropped), family.name)
        try:
            job = to_dataclass(cfg, family.config_class)
        except UnknownKeyError as err:  # one clean line, like Hydra's own override errors
            print(f"bad config: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        _write_config(cfg, job)
        return train(job, family)

    return _run()


def _write_config(cfg: DictConfig, job: Any) -> None:
    """Rank 0 (by launcher env) saves the resolved config as ``run.dir/config.yaml``."""
    if env_rank() != 0:
        return
    path = Path(job.run.dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")


def load_job(run_dir: str | Path, family: Family) -> Any:
    """The typed job config a run was trained with (``run.dir/config.yaml``)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pass the run.dir of a training run")
    saved = OmegaConf.load(path)
    cls = family.config_class
    if usermodel.is_user_model(saved.get("model")):  # trained with model._target_=...
        cls = usermodel.job_class(cls)
    return to_dataclass(OmegaConf.merge(OmegaConf.structured(cls), saved), cls)
