"""Shared fixtures, and the test tiers.

Every test belongs to one tier (a pytest marker; ``scripts/test.sh -m unit`` runs one):

- ``unit``: pure logic and single-process work on real files, no spawned ranks; the
  whole tier runs in well under a minute.
- ``ranks``: several gloo ranks of the spawned pool (``tests/harness.py``).
- ``launch``: real launches (``python -m``, torchrun, mpirun, Slurm variables, scripts).

A module's tier is in ``TIERS``; a test of another tier in that module carries its own
marker (``@pytest.mark.launch``). ``slow`` marks, besides, the longest launches (``SLOW``:
40 s or more each on a loaded 2-core machine); ``-m "not slow"`` leaves them out.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Pools  # noqa: E402

TIER_NAMES = ("unit", "ranks", "launch")
TIERS = {
    "test_bad_input": "unit",
    "test_cases_preflight": "unit",
    "test_comm_adjoint": "ranks",
    "test_comm_layer": "unit",
    "test_layout": "unit",
    "test_kernels_low_precision": "unit",
    "test_gpu_check": "launch",
    "test_public_api": "launch",
    "test_rng_restore": "unit",
    "test_startup": "unit",
    "test_benchmark": "launch",
    "test_cluster_placement": "unit",
    "test_cluster_scripts": "launch",
    "test_augment": "ranks",
    "test_data_benchmark": "launch",
    "test_data_crops": "unit",
    "test_data_reader": "unit",
    "test_data_sampler": "unit",
    "test_data_staging": "ranks",
    "test_fail_checkpoint": "launch",
    "test_fail_ranks": "launch",
    "test_fail_security": "unit",
    "test_halo": "ranks",
    "test_launchers": "launch",
    "test_kfac": "unit",
    "test_kfac_grid": "ranks",
    "test_kfac_loop": "unit",
    "test_kfac_train": "launch",
    "test_memory_budget": "launch",
    "test_layers": "ranks",
    "test_layers_resample": "ranks",
    "test_monai": "ranks",
    "test_mlperf_unet": "unit",
    "test_models": "unit",
    "test_overlap": "ranks",
    "test_parallelize": "ranks",
    "test_partition": "unit",
    "test_plan": "unit",
    "test_plan_auto": "launch",
    "test_plan_layers": "unit",
    "test_predict": "launch",
    "test_prepare_cosmoflow": "unit",
    "test_prepare_unet3d": "unit",
    "test_resume_grid": "launch",
    "test_schedule_reference": "unit",
    "test_shard": "ranks",
    "test_sliding_window": "ranks",
    "test_train_cases": "launch",
    "test_train_config": "unit",
    "test_train_equivalence": "launch",
    "test_train_resume": "launch",
    "test_train_runs": "unit",
    "test_train_sweeps": "launch",
    "test_docs_commands": "launch",
    "test_train_state": "unit",
    "test_user_model_config": "unit",
    "test_user_models": "launch",
    "test_verify": "ranks",
    "test_watchdog": "unit",
}

SLOW = {
    "test_cluster_scripts.py::test_documented_weak_scaling_submission",
    "test_fail_checkpoint.py::test_kill_during_checkpoint_write_then_resume",
    "test_fail_ranks.py::test_kill_one_of_four_ranks_stops_the_job",
    "test_kfac_train.py::test_kfac_stopped_at_one_grid_resumes_at_another",
    "test_launchers.py::test_spatial_1x2x2_equals_plain_python_under_torchrun_mpirun_and_slurm",
    "test_predict.py::test_cosmoflow_predict_rows_equal_at_every_grid",
    "test_predict.py::test_unet_predict_says_what_it_read_and_refuses_user_errors_in_one_line",
    "test_mlperf_unet.py::test_a_short_closed_run_over_168_42_cases_logs_every_key_the_rules_ask_for",
    "test_schedule_reference.py::test_the_loop_sets_the_reference_rate_at_every_step",
    "test_train_cases.py::test_cases_of_six_shapes_train_alike_at_every_grid_reading_only_their_share",
    "test_train_cases.py::test_a_crop_or_case_the_network_cannot_take_stops_before_training",
    "test_resume_grid.py::test_stop_at_one_grid_resume_at_others",
    "test_train_equivalence.py::test_data_and_spatial_axes_interchange",
    "test_train_equivalence.py::test_spatial_splits_equal_serial",
    "test_train_runs.py::test_a_used_run_dir_is_refused_overwritten_aside_or_resumed",
    "test_train_sweeps.py::test_sweep_gives_each_job_its_run_dir_and_a_table",
    "test_train_sweeps.py::test_submitit_launcher_starts_each_jobs_ranks",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test its module's tier unless it carries one; refuse a module without one."""
    missing = set()
    for item in items:
        if f"{Path(str(item.fspath)).name}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)
        own = [m.name for m in item.iter_markers() if m.name in TIER_NAMES]
        if len(set(own)) > 1:
            raise pytest.UsageError(f"{item.nodeid} carries tiers {own}: one at most")
        if own:
            continue
        module = Path(str(item.fspath)).stem
        if module not in TIERS:
            missing.add(module)
            continue
        item.add_marker(getattr(pytest.mark, TIERS[module]))
    if missing:
        raise pytest.UsageError(f"test module(s) {', '.join(sorted(missing))} have no tier: add them to TIERS in "
                                f"tests/conftest.py ({', '.join(TIER_NAMES)})")


@pytest.fixture(scope="session", autouse=True)
def job_pool(tmp_path_factory):
    """The session's pool of rank processes for ``python -m`` jobs, and its cache of
    generated data sets (``train_helpers.launch``/``prepare``); both started on first use."""
    import train_helpers
    from jobpool import JobPool

    train_helpers.POOL = JobPool()
    train_helpers.CACHE = tmp_path_factory.mktemp("datasets")
    yield train_helpers.POOL
    train_helpers.POOL.close()
    train_helpers.POOL = None


@pytest.fixture(scope="session")
def pools():
    """Spawned gloo worlds of 2, 3 and 4 ranks, started on first use and reused."""
    p = Pools()
    yield p
    p.close()
