"""Hydra's composed config -> the typed dataclass tree of ``parallel.job.config``, refusing
keys no section declares; and the typed config a run was trained with (``load_job``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


class UnknownKeyError(KeyError):
    """A config key that no section declares (``+train.foo=1``, a typo in a YAML file)."""

    def __str__(self) -> str:
        return str(self.args[0])


def unknown_keys(cfg: Any, cls: type) -> list[str]:
    """Dotted keys of ``cfg`` (a DictConfig) that the dataclass ``cls`` does not declare."""
    from omegaconf import DictConfig, OmegaConf

    def walk(node: Any, schema: Any, prefix: str) -> list[str]:
        if not isinstance(node, DictConfig) or not isinstance(schema, DictConfig):
            return []
        if OmegaConf.get_type(schema) in (None, dict):  # a free-form mapping
            return []
        out = []
        for key in node.keys():
            name = f"{prefix}{key}"
            if key not in schema:
                out.append(name)
            else:
                out.extend(walk(node._get_node(key), schema._get_node(key), f"{name}."))
        return out

    return walk(cfg, _schema(cls), "")


@functools.lru_cache(maxsize=8)
def _schema(cls: type) -> Any:
    """``cls`` as an OmegaConf schema, built once per class (it is only read)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(cls)


def to_dataclass(cfg: Any, cls: type) -> Any:
    """A DictConfig composed by Hydra -> the typed dataclass tree (``OmegaConf.to_object``).

    Raises ``UnknownKeyError`` naming every key ``cls`` does not declare (Hydra lets
    ``+section.key=value`` add one, and the conversion would silently drop it).
    """
    from omegaconf import OmegaConf

    if isinstance(cfg, cls):
        return cfg
    unknown = unknown_keys(cfg, cls)
    if unknown:
        raise UnknownKeyError(f"unknown config key(s) {', '.join(unknown)}: no field of that name in "
                              f"{cls.__name__} (python -m <model>.train --cfg job lists them all)")
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, cls):
        raise TypeError(f"config resolved to {type(obj).__name__}, expected {cls.__name__}")
    return obj


def load_job(run_dir: str | Path, family: Any) -> Any:
    """The typed job config a run was trained with (``run.dir/config.yaml``)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pass the run.dir of a training run")
    from omegaconf import OmegaConf

    from parallel.job import usermodel

    saved = OmegaConf.load(path)
    cls = family.config_class
    if usermodel.is_user_model(saved.get("model")):  # trained with model._target_=...
        cls = usermodel.job_class(cls)
    return to_dataclass(OmegaConf.merge(OmegaConf.structured(cls), saved), cls)
