"""Bad input stops a job before training, with a message that names the culprit.

Most cases run the pre-flight checks in-process on real (deliberately broken) HDF5 files;
a few launch the real entry point to show the clean exit: one message, no traceback,
non-zero status.
"""



import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from cosmoflow.family import FAMILY as COSMO
from cosmoflow.family import CosmoFlowJob
from parallel.job.config import UnknownKeyError, to_dataclass
from parallel.job.errors import ConfigError
from parallel.train.checks.config import validate_config
from parallel.train.cli import CONFIG_ROOT, register


def test_config_values_and_types():
    job = CosmoFlowJob()
    job.parallel.spatial = [2, 1]
    with pytest.raises(ConfigError, match=r"parallel\.spatial=\[2, 1\]: want three positive ints"):
        validate_config(job)
    job = CosmoFlowJob()
    job.run.keep_checkpoints = 0
    with pytest.raises(ConfigError, match=r"run\.keep_checkpoints=0: want >= 1"):
        validate_config(job)
    register(COSMO)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        with pytest.raises((ConfigCompositionException, ValidationError), match=r"train\.foo"):
            compose(config_name="quickstart", overrides=["train.foo=1"])
        with pytest.raises((ConfigCompositionException, ValidationError)) as info:
            compose(config_name="quickstart", overrides=["train.epochs=many"])
        assert "train.epochs" in str(info.value) or "train.epochs" in str(info.value.__cause__)
        with pytest.raises((ConfigCompositionException, ValidationError)) as info:
            to_dataclass(compose(config_name="quickstart", overrides=["data.nonfinite=ignore"]), CosmoFlowJob)
        assert "nonfinite" in str(info.value) + str(info.value.__cause__)
        added = compose(config_name="quickstart", overrides=["+train.foo=1", "+model.bar=2"])  # Hydra allows '+'
        with pytest.raises(UnknownKeyError, match=r"unknown config key\(s\) train\.foo, model\.bar"):
            to_dataclass(added, CosmoFlowJob)
    job = CosmoFlowJob()
    job.parallel.spatial = "abc"
    with pytest.raises(ConfigError, match=r"parallel\.spatial=abc: want three positive ints"):
        validate_config(job)
    job.parallel.spatial = "auto"  # a value the config accepts: the planner chooses at start-up
    validate_config(job)
    job.parallel.channels_last = "yes"
    with pytest.raises(ConfigError, match=r"parallel\.channels_last=yes: want true, false or auto"):
        validate_config(job)



def test_channels_last_auto_is_on_only_where_it_was_measured_faster():
    import torch

    from parallel.split.layout import preferred

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    assert preferred(cpu, "fp32")
    assert not any(preferred(cpu, p) for p in ("fp64", "bf16", "fp16"))
    assert not any(preferred(gpu, p) for p in ("fp32", "fp64", "bf16", "fp16"))
