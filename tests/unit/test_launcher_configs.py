"""The Hydra launcher configs (``spatial_slurm``, ``spatial_local``) take the spatial group's
tasks per node; with ``parallel.spatial=auto`` that count is unknown and reading it fails
by name. (Sweeps that run: tests/launch/test_train_sweeps.py.)"""

import pytest
from hydra import compose, initialize_config_dir

from cosmoflow.family import FAMILY as COSMO
from parallel.train.cli import CONFIG_ROOT, register


def test_launcher_configs_take_the_spatial_groups_tasks_per_node():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    register(COSMO)
    with initialize_config_dir(config_dir=str(CONFIG_ROOT / "cosmoflow"), version_base=None):
        for name, target in (("spatial_slurm", "SlurmLauncher"), ("spatial_local", "LocalLauncher")):
            cfg = compose(config_name="quickstart", return_hydra_config=True,
                          overrides=[f"hydra/launcher={name}", "parallel.spatial=[2,2,1]"])
            launcher = cfg.hydra.launcher
            assert launcher._target_.endswith(target) and launcher.tasks_per_node == 4 and launcher.nodes == 1
        auto = compose(config_name="quickstart", return_hydra_config=True,
                       overrides=["hydra/launcher=spatial_slurm", "parallel.spatial=auto"])
        with pytest.raises(Exception, match=r"hydra\.launcher\.tasks_per_node"):
            _ = auto.hydra.launcher.tasks_per_node
