"""Any network in a family's training loop: a ``model`` section with ``_target_``.

``python -m unet3d.train model._target_=monai.networks.nets.SegResNet model.init_filters=16
model.out_channels=3`` trains MONAI's SegResNet with the U-Net family's data, loss, metric,
loop, launchers, checkpoints and logs: the ``model`` section is then the keyword arguments
of ``_target_`` (Hydra's ``instantiate``), whatever they are, and nothing else. The
family's own typed model section (``UNet3DConfig``, ``CosmoFlowConfig``) and its
validation apply whenever ``_target_`` is absent.

The pieces: ``prepare_argv`` (before Hydra composes: lets ``model.<key>=...`` add keys and
notes which ones the command line gave), ``job_class`` (the family's job with a free-form
``model`` mapping, registered under the family's schema name), ``keep_command_line``
(after composing: a config file's model keys belong to the family's own network and are
left out), ``build_user_model`` (what every ``Family.build_model`` does with such a
section) and ``check_user_model`` (the network against the family's fields, before
training: input channels, output shape). See docs/training.md, "Any model in the loop".
"""

from __future__ import annotations

import dataclasses
import logging
import re
from functools import lru_cache
from typing import Any, Dict, Sequence

import torch
from torch import nn

from parallel.model.trace import meta_copy, meta_forward, on_meta

log = logging.getLogger("parallel.train")

TARGET = "_target_"
_MODEL_KEY = re.compile(r"^(\+{0,2})model\.([^.=\[]+)(.*)$")


def is_user_model(cfg: Any) -> bool:
    """Whether a ``model`` section names its network by ``_target_``."""
    try:
        return TARGET in cfg and bool(cfg[TARGET])  # dicts and DictConfigs alike
    except TypeError:  # a dataclass: the family's own typed section
        return False


def prepare_argv(argv: Sequence[str]) -> tuple[bool, list[str], set[str]]:
    """(whether the command line sets ``model._target_``, the arguments to hand Hydra, the
    model keys the command line gives).

    With ``_target_`` the model section is free-form, and Hydra refuses to add a key to a
    config node without a ``+`` (``++`` adds or overrides); the ``model.*`` overrides are
    rewritten so. Other arguments pass unchanged.
    """
    user = any((m := _MODEL_KEY.match(a)) and m.group(2) == TARGET and m.group(3).startswith("=") for a in argv)
    if not user:
        return False, list(argv), set()
    out, keys = [], set()
    for a in argv:
        m = _MODEL_KEY.match(a)
        if m and "=" in a:
            keys.add(m.group(2))
            a = f"++model.{m.group(2)}{m.group(3)}"
        out.append(a)
    return True, out, keys


@lru_cache(maxsize=None)
def job_class(config_class: type) -> type:
    """The family's job config with a free-form ``model`` mapping (``_target_`` and any keys)."""
    cls = dataclasses.make_dataclass(
        f"{config_class.__name__}UserModel",
        [("model", Dict[str, Any], dataclasses.field(default_factory=dict))],
        bases=(config_class,))
    cls.__doc__ = (f"{config_class.__doc__ or config_class.__name__}\n\nThe model section is a network's "
                   "keyword arguments with its class as ``_target_`` (parallel.job.usermodel).")
    return cls


def keep_command_line(cfg: Any, keys: set[str]) -> list[str]:
    """Leave out of ``cfg.model`` (a composed DictConfig) the keys the command line did not
    give: a config file's model keys describe the family's own network. Returns them."""
    from omegaconf import open_dict

    dropped = [str(k) for k in cfg.model.keys() if str(k) not in keys]
    if dropped:
        with open_dict(cfg):
            for k in dropped:
                del cfg.model[k]
    return dropped


def build_user_model(cfg: Any, volume: Sequence[int] | None = None) -> nn.Module:
    """``_target_(**rest)`` of a model section (Hydra's ``instantiate``; nested sections with
    their own ``_target_`` are built too). ``volume`` is not passed: the network is built
    from its own keys. Raises ``ValueError`` naming ``model._target_`` when it cannot."""
    from hydra.errors import HydraException
    from hydra.utils import instantiate

    target = cfg[TARGET]
    try:
        model = instantiate(dict(cfg) if isinstance(cfg, dict) else cfg, _convert_="all")
    except (HydraException, ImportError, TypeError, ValueError) as err:
        cause = err.__cause__ or err
        raise ValueError(f"model._target_={target}: cannot build the network ({type(cause).__name__}: "
                         f"{cause}); the model section holds its keyword arguments (model.<name>=value)") from err
    if not isinstance(model, nn.Module):
        raise ValueError(f"model._target_={target} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def input_channels(model: nn.Module, default: int) -> int:
    """The input channels of the network's first layer that declares them, else ``default``."""
    for m in model.modules():
        if isinstance(getattr(m, "in_channels", None), int):
            return int(m.in_channels)  # type: ignore[arg-type]
    return default


def check_user_model(model: nn.Module, family: Any, target_cfg: Any, volume: Sequence[int], channels: int) -> None:
    """A user network against the family's data, on the meta device (no memory, no work):
    it takes the input field's channels, and its output has the shape the family's loss
    compares with the target field. Raises ``ValueError`` saying which model key to set."""
    name = target_cfg[TARGET]
    volume = tuple(int(v) for v in volume)
    try:  # in eval mode: BatchNorm refuses one voxel of one sample in training mode
        out = meta_forward((model if on_meta(model) else meta_copy(model)).eval(), (channels, *volume))
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        hint = ""
        if re.search(r"to have \d+ channels|channel dimensions", str(err)):
            hint = (f" The data's {family.input_field!r} field has {channels} channel(s): set the network's "
                    "input channels (model.in_channels=..., model.n_input_channels=... for MONAI's ResNets).")
        raise ValueError(f"model._target_={name} cannot run on one sample of shape {(channels, *volume)} "
                         f"({type(err).__name__}: {err}).{hint}") from err
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"model._target_={name} returns a {type(out).__name__}; the {family.name} loss takes "
                         "one tensor (switch deep supervision or auxiliary outputs off)")
    field = family.spec[family.target_field]
    got = tuple(out.shape)
    if field.kind == "scalar":
        want = (1, *field.shape)
        if got != want:
            raise ValueError(f"model._target_={name} returns {got} for one sample; the {family.name} loss compares "
                             f"it with {family.target_field!r} of shape {tuple(field.shape)} per sample: set its "
                             f"outputs to {int(torch.Size(field.shape).numel())} (model.out_channels=..., "
                             "model.num_classes=...)")
        return
    classes = int(field.valid_range[1]) + 1 if field.valid_range is not None else 1
    if len(got) != 5 or got[2:] != volume or got[1] < classes:
        raise ValueError(f"model._target_={name} returns {got} for one sample of {volume}; the {family.name} loss "
                         f"wants logits (1, C, {', '.join(map(str, volume))}) with C >= {classes} "
                         f"(labels 0..{classes - 1} in {family.target_field!r}): set model.out_channels={classes}")
