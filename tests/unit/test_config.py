"""The shipped Hydra configs of both families compose with overrides into their job
dataclasses, and bad values are refused by name."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from cosmoflow.family import FAMILY as COSMO
from cosmoflow.family import CosmoFlowJob
from parallel.job.config import to_dataclass
from parallel.train.cli import CONFIG_ROOT, register
from unet3d.family import FAMILY as UNET


@pytest.mark.parametrize("family,name", [(COSMO, "default"), (COSMO, "quickstart"), (COSMO, "mlperf512"),
                                         (UNET, "default"), (UNET, "quickstart")])
def test_configs_compose_with_overrides(family, name):
    register(family)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / family.name), version_base=None):
        cfg = compose(config_name=name, overrides=[
            "parallel.spatial=[2,2,1]", "train.global_batch_size=12", "train.epochs=3", "train.max_steps=7",
            "train.seed=5", "train.resume=true", "run.dir=/tmp/x", "data.dir=/tmp/d", "optim.name=adamw"])
    job = to_dataclass(cfg, family.config_class)
    assert job.parallel.spatial == [2, 2, 1] and job.train.global_batch_size == 12
    assert (job.train.epochs, job.train.max_steps, job.train.seed, job.train.resume) == (3, 7, 5, True)
    assert job.run.dir == "/tmp/x" and job.data.dir == "/tmp/d" and job.optim.name == "adamw"
    assert type(job.model).__name__ == ("CosmoFlowConfig" if family is COSMO else "UNet3DConfig")


def test_config_rejects_bad_values():
    register(COSMO)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        with pytest.raises((ConfigCompositionException, ValidationError), match="adam"):
            compose(config_name="default", overrides=["optim.name=adam"])
        cfg = compose(config_name="default", overrides=["model.dropout=0.25"])
    assert to_dataclass(cfg, CosmoFlowJob).model.dropout == 0.25
