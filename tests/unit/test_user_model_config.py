"""``model._target_=...``: the model section of any family becomes a network's keyword
arguments (composed by Hydra, built by ``instantiate``, checked against the family's
fields), while the families' typed model sections keep their validation; the framework
imports without MONAI; ``parallel.verify`` chooses its probe and when to run."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError
from torch import nn

from cosmoflow.family import FAMILY as COSMO
from parallel.grid import Grid
from parallel.job import usermodel
from parallel.job.config import UnknownKeyError, to_dataclass
from parallel.job.errors import InputError
from parallel.train.checks import equivalence
from parallel.train.checks.fit import check_model, check_volume
from parallel.train.cli import CONFIG_ROOT, load_job, register
from parallel.verify.probe import choose_probe
from train_helpers import REPO
from unet3d.family import FAMILY as UNET

SEGRESNET = ["model._target_=monai.networks.nets.SegResNet", "model.init_filters=8", "model.out_channels=3",
             "model.blocks_down=[1,1]", "+model.blocks_up=[1]"]


def _compose(family, argv: list[str], name: str = "quickstart"):
    """What ``python -m <family>.train ARGV`` composes (the CLI's steps, without training)."""
    user, argv, keys = usermodel.prepare_argv(argv)
    if user:
        family = dataclasses.replace(family, config_class=usermodel.job_class(family.config_class))
    register(family)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / family.name), version_base=None):
        cfg = compose(config_name=name, overrides=argv)
    dropped = usermodel.keep_command_line(cfg, keys) if user else []
    return to_dataclass(cfg, family.config_class), dropped, cfg


def test_command_line_target_makes_the_model_section_free_form():
    job, dropped, _ = _compose(UNET, [*SEGRESNET, "parallel.spatial=[2,1,1]"])
    assert job.model == {"_target_": "monai.networks.nets.SegResNet", "init_filters": 8, "out_channels": 3,
                         "blocks_down": [1, 1], "blocks_up": [1]}
    assert sorted(dropped) == ["base_filters", "depth", "max_filters"]  # quickstart.yaml's U-Net keys
    assert job.parallel.spatial == [2, 1, 1] and job.train.global_batch_size == 4  # the rest is the family's
    net = UNET.build_model(job.model, (16, 16, 16))
    assert type(net).__name__ == "SegResNet" and net.init_filters == 8


def test_typed_model_sections_keep_their_validation():
    job, _, _ = _compose(UNET, ["model.depth=2"])
    assert type(job.model).__name__ == "UNet3DConfig" and job.model.depth == 2
    with pytest.raises(ConfigCompositionException):
        _compose(UNET, ["model.init_filters=8"])  # no such field without _target_
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(COSMO, ["model.n_conv_blocks=abc"])
    with pytest.raises(UnknownKeyError, match="model.bogus"):
        _compose(COSMO, ["+model.bogus=1"])


def test_argv_rewriting_touches_only_model_keys():
    user, argv, keys = usermodel.prepare_argv(["--config-name", "quickstart", "model._target_=a.B", "model.x=[1,2]",
                                               "++model.y.z=3", "train.seed=1", "~model.w"])
    assert user and keys == {"_target_", "x", "y"}
    assert argv == ["--config-name", "quickstart", "++model._target_=a.B", "++model.x=[1,2]", "++model.y.z=3",
                    "train.seed=1", "~model.w"]
    assert usermodel.prepare_argv(["model.depth=2"]) == (False, ["model.depth=2"], set())


def test_a_run_trained_with_a_user_model_loads_its_job(tmp_path):
    job, _, cfg = _compose(COSMO, ["model._target_=monai.networks.nets.DenseNet121", "model.spatial_dims=3",
                                   "model.in_channels=4", "model.out_channels=4"])
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    loaded = load_job(tmp_path, COSMO)
    assert loaded.model == job.model and loaded.train == job.train


def test_networks_that_cannot_be_built_say_which_key():
    with pytest.raises(ValueError, match=r"model._target_=no.such.Net: cannot build the network"):
        COSMO.build_model({"_target_": "no.such.Net"}, (8, 8, 8))
    with pytest.raises(ValueError, match=r"model._target_=monai.networks.nets.SegResNet: cannot build.*depth"):
        UNET.build_model({"_target_": "monai.networks.nets.SegResNet", "depth": 3}, (8, 8, 8))
    with pytest.raises(ValueError, match="returned a Tensor, not a torch.nn.Module"):
        UNET.build_model({"_target_": "torch.zeros", "size": [2]}, (8, 8, 8))


@pytest.mark.parametrize("family,cfg,match", [
    (UNET, {"_target_": "monai.networks.nets.SegResNet", "blocks_down": [1, 1], "blocks_up": [1]},
     r"returns \(1, 2, 32, 32, 32\) .* C >= 3 .*set model.out_channels=3"),
    (UNET, {"_target_": "monai.networks.nets.SegResNet", "in_channels": 4, "out_channels": 3},
     r"cannot run on one sample of shape \(1, 32, 32, 32\).*'image' field has 1 channel\(s\)"),
    (COSMO, {"_target_": "monai.networks.nets.DenseNet121", "spatial_dims": 3, "in_channels": 4, "out_channels": 2},
     r"returns \(1, 2\) for one sample; .*'target' of shape \(4,\).*set its outputs to 4"),
    (COSMO, {"_target_": "monai.networks.nets.UNet", "spatial_dims": 3, "in_channels": 4, "out_channels": 4,
             "channels": [4, 8], "strides": [2]}, r"returns \(1, 4, 32, 32, 32\) for one sample"),
], ids=["unet3d-too-few-classes", "unet3d-wrong-input-channels", "cosmoflow-two-outputs", "cosmoflow-volume-output"])
def test_user_networks_that_do_not_fit_the_family_are_refused(family, cfg, match):
    channels = 4 if family is COSMO else 1
    with pytest.raises(InputError, match=match):  # before any process group: no grid needed
        check_volume(family, cfg, (32, 32, 32), channels)


def test_a_network_with_a_global_pool_passes_the_split_check():
    cfg = {"_target_": "monai.networks.nets.DenseNet", "spatial_dims": 3, "in_channels": 4, "out_channels": 4,
           "init_features": 8, "growth_rate": 4, "block_config": [2, 2]}
    check_model(COSMO, cfg, (16, 16, 16), 4, Grid((2, 1, 1), 2, 0))  # 16 -> 2 at the deepest level, then pooled
    with pytest.raises(InputError, match=r"cannot be split 4 ways"):
        check_model(COSMO, cfg, (16, 16, 16), 4, Grid((4, 1, 1), 4, 0))


def test_the_framework_imports_without_monai():
    code = ("import sys; sys.modules['monai'] = None\n"  # any 'import monai' now raises ImportError
            "import parallel, parallel.verify, parallel.plan, parallel.verify.selfcheck, parallel.train.lifecycle\n"
            "import cosmoflow.train, unet3d.train, cosmoflow.predict, unet3d.predict\n"
            "from parallel.plan import build_model, trace\n"
            "m, shape, _ = build_model('unet3d', (16, 16, 16), ['model.depth=2', 'model.base_filters=2'])\n"
            "assert trace(m, shape)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


class _Plain(nn.Sequential):
    pass


def test_verification_runs_when_auto_finds_code_it_cannot_see():
    grid = Grid((2, 1, 1), 2, 0)
    plain = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU())
    custom = _Plain(nn.Conv3d(1, 2, 3, padding=1))
    copy = equivalence.serial_copy
    assert copy("auto", plain, grid, user_model=False) is None  # torch.nn layers only: nothing to find
    assert copy("auto", plain, grid, user_model=True) is not None  # a model._target_ network: always checked
    assert copy("auto", custom, grid, user_model=False) is not None
    assert copy("auto", custom, Grid((1, 1, 1), 2, 0), user_model=False) is None  # data parallel only
    assert copy(True, plain, Grid((1, 1, 1), 1, 0), user_model=False) is not None
    assert copy("false", custom, grid, user_model=True) is None


def test_probe_is_small_where_the_network_allows_and_whole_where_it_must():
    from cosmoflow.model import CosmoFlow, CosmoFlowConfig

    grid = Grid((2, 1, 1), 2, 0)
    unet = UNET.build_model(OmegaConf.to_object(OmegaConf.structured(UNET.config_class).model), (128, 128, 128))
    probe, how = choose_probe(unet, grid, 1, (128, 128, 128), whole_limit=0)
    assert probe == (1, 1, 64, 64, 64) and how == "sized from the network"  # 5 halvings: 32 x at least 2
    cosmo = CosmoFlow(CosmoFlowConfig(n_conv_blocks=3, conv_filters=2, dense_sizes=[4]), (32, 32, 32))
    probe, how = choose_probe(cosmo, grid, 4, (32, 32, 32), whole_limit=32**3)
    assert probe == (1, 4, 32, 32, 32) and how.startswith("one whole sample")  # Flatten+Linear fixes the size
    probe, why = choose_probe(cosmo, grid, 4, (32, 32, 32), whole_limit=32**3 - 1)
    assert probe is None and f"over {32**3 - 1} voxels" in why


def test_parallel_verify_takes_auto_true_or_false():
    from parallel.job.errors import ConfigError
    from parallel.train.checks.config import validate_config

    job, _, _ = _compose(UNET, ["parallel.verify=true"])
    assert job.parallel.verify is True
    validate_config(job)
    job.parallel.verify = "sometimes"
    with pytest.raises(ConfigError, match="parallel.verify=sometimes: want auto, true or false"):
        validate_config(job)
