"""Shared fixtures, and the test tiers.

Every test belongs to one tier (a pytest marker; ``scripts/test.sh -m unit`` runs one):

- ``unit``: pure logic and single-process work on real files, no spawned ranks; the
  whole tier runs in well under a minute.
- ``ranks``: several gloo ranks of the spawned pool (``tests/harness.py``).
- ``launch``: jobs of the entry points (``python -m cosmoflow.train`` ...) and real
  launches. Jobs that prove numbers (equivalence, cases, resume across grids, K-FAC,
  user models, predict, runs, schedules) run on the session's job pool
  (``tests/jobpool.py``: rank processes that imported torch once, each job given
  torchrun's variables, its argv, cwd and output; ``train_helpers.launch``/``python_m``);
  what is about the launcher or the process itself (torchrun, mpirun, Slurm, kills, exit
  codes of dying ranks, scripts) starts real processes. Generated data sets are made once
  per session and shared read-only (``train_helpers.prepare``; a test that changes files
  takes ``prepare_copy``).

A module's tier is in ``TIERS``; a test of another tier in that module carries its own
marker (``@pytest.mark.launch``). ``slow`` marks, besides, the longest launches (``SLOW``:
40 s or more each on a loaded 2-core machine); ``-m "not slow"`` leaves them out.

``nightly`` (not in CI, not in a plain run: ``scripts/test.sh -m nightly`` runs it) holds
only repeats of what CI proves elsewhere, each named in ``NIGHTLY`` with the CI test that
carries its proof.
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
    "test_jobpool": "launch",
    "test_monitor": "unit",
    "test_job_checks": "unit",
    "test_comm_adjoint": "ranks",
    "test_comm_layer": "unit",
    "test_layout": "unit",
    "test_kernels_low_precision": "unit",
    "test_gpu_check": "launch",
    "test_public_api": "launch",
    "test_rng_restore": "unit",
    "test_startup": "unit",
    "test_step_time": "unit",
    "test_compile": "ranks",
    "test_benchmark": "launch",
    "test_results_table": "unit",
    "test_cluster_placement": "unit",
    "test_cluster_scripts": "launch",
    "test_augment": "ranks",
    "test_data_benchmark": "launch",
    "test_data_crops": "unit",
    "test_data_reader": "unit",
    "test_data_sampler": "unit",
    "test_data_staging": "ranks",
    "test_elastic": "launch",
    "test_fail_checkpoint": "launch",
    "test_fail_ranks": "launch",
    "test_fail_security": "unit",
    "test_halo": "ranks",
    "test_launchers": "launch",
    "test_launch_decisions": "unit",
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
    "test_channels_last": "ranks",
    "test_slurm_real": "launch",
    "test_sliding_window": "ranks",
    "test_train_cases": "launch",
    "test_train_config": "unit",
    "test_contract_matrix": "launch",
    "test_train_resume": "launch",
    "test_train_runs": "unit",
    "test_train_sweeps": "launch",
    "test_docs_commands": "launch",
    "test_train_state": "unit",
    "test_user_model_config": "unit",
    "test_user_models": "launch",
    "test_verify": "ranks",
    "test_torch_floor": "unit",
    "test_device_paths": "unit",
    "test_peak_memory": "unit",
    "test_random_draws": "ranks",
    "test_step_audit": "ranks",
    "test_gpu_check_timeouts": "launch",
    "test_watchdog": "unit",
}

SLOW = {
    "test_cluster_scripts.py::test_documented_weak_scaling_submission",
    "test_elastic.py::test_a_node_dies_and_the_job_finishes_on_the_survivors",
    "test_elastic.py::test_a_node_dies_and_the_cosmoflow_job_finishes_on_the_survivors",
    "test_fail_checkpoint.py::test_kill_during_checkpoint_write_then_resume",
    "test_fail_ranks.py::test_kill_one_of_four_ranks_stops_the_job",
    "test_kfac_train.py::test_kfac_stopped_at_one_grid_resumes_at_another",
    "test_launchers.py::test_each_launcher_at_4_ranks_equals_plain_python",
    "test_predict.py::test_cosmoflow_predict_rows_equal_at_every_grid",
    "test_predict.py::test_unet_predict_says_what_it_read_and_refuses_user_errors_in_one_line",
    "test_mlperf_unet.py::test_a_short_closed_run_over_168_42_cases_logs_every_key_the_rules_ask_for",
    "test_schedule_reference.py::test_the_loop_sets_the_reference_rate_at_every_step",
    "test_slurm_real.py::test_strong_submission_and_a_repeated_job_id",
    "test_slurm_real.py::test_scancel_mid_run_leaves_a_usable_checkpoint_and_a_resubmission_resumes",
    "test_slurm_real.py::test_time_limit_warning_checkpoints_and_the_next_submission_resumes_to_the_same_weights",
    "test_train_cases.py::test_cases_of_six_shapes_train_alike_at_every_grid_reading_only_their_share",
    "test_train_cases.py::test_a_crop_or_case_the_network_cannot_take_stops_before_training",
    "test_resume_grid.py::test_stop_at_one_grid_resume_at_others",
    "test_train_runs.py::test_a_used_run_dir_is_refused_overwritten_aside_or_resumed",
    "test_train_sweeps.py::test_sweep_gives_each_job_its_run_dir_and_a_table",
    "test_train_sweeps.py::test_submitit_launcher_starts_each_jobs_ranks",
}

# The longest modules first (seconds on a quiet 2-core machine, run alone), so that
# pytest-xdist's per-file scheduling (scripts/test.sh: -n 2 --dist loadfile) starts them
# early instead of leaving one of them alone at the end; the rest keep their order.
LONGEST_FIRST = {
    "test_slurm_real": 121, "test_docs_commands": 70, "test_monai": 66, "test_cluster_scripts": 60,
    "test_contract_matrix": 55, "test_elastic": 49, "test_benchmark": 45, "test_train_cases": 25,
    "test_train_sweeps": 25, "test_launchers": 22, "test_gpu_check": 21, "test_jobpool": 19,
    "test_watchdog": 18, "test_fail_ranks": 18, "test_bad_input": 15,
}


NIGHTLY = {
    # the nightly test -> the CI test that carries the same proof
    "test_elastic.py::test_a_node_dies_and_the_cosmoflow_job_finishes_on_the_survivors":
        "test_elastic.py::test_a_node_dies_and_the_job_finishes_on_the_survivors (the elastic path: the U-Net at "
        "spatial 2, data 2 -> 1, accumulation 2; the loop is shared); CosmoFlow's accumulation and clipping equal "
        "serial: test_contract_matrix.py::test_cosmoflow_sgd_options_equal_serial_in_float64; its resume at "
        "another grid: test_resume_grid.py::test_stop_at_one_grid_resume_at_others",
    "test_cluster_scripts.py::test_sbatch_strong_scaling_two_runs":
        "test_slurm_real.py::test_strong_submission_and_a_repeated_job_id (run.sub through a real sbatch and srun, "
        "NEXP=2 runs in a row with their seeds, collected and checked) and "
        "test_slurm_real.py::test_weak_submission_on_two_nodes (two nodes, --relative)",
    "test_public_api.py::test_public_api_program_exits_cleanly_20_times":
        "test_public_api.py::test_public_api_program_exits_cleanly (one run per launcher)",
    "test_gpu_check.py::test_gpu_check_cpu_dry_run_whole":
        "test_gpu_check.py::test_gpu_check_cpu_dry_run_passes (the script, its self-checks and probe); its "
        "nested layer tests are the ranks tier's own; its bf16 train/resume/predict steps on the CPU: "
        "test_train_resume.py::test_gradient_accumulation_matches_and_bf16_runs, test_contract_matrix.py (bf16), "
        "test_fail_checkpoint.py::test_kill_during_checkpoint_write_then_resume, test_predict.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test its module's tier unless it carries one; refuse a module without one;
    leave the nightly tier out unless ``-m`` names it."""
    missing = set()
    names = {f"{Path(str(item.fspath)).name}::{item.originalname}" for item in items}
    unknown = [n for n in NIGHTLY if n.split("::")[0] in {k.split("::")[0] for k in names} and n not in names]
    if unknown:
        raise pytest.UsageError(f"NIGHTLY in tests/conftest.py names missing tests: {unknown}")
    for item in items:
        if f"{Path(str(item.fspath)).name}::{item.originalname}" in NIGHTLY:
            item.add_marker(pytest.mark.nightly)
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
    items.sort(key=lambda item: -LONGEST_FIRST.get(Path(str(item.fspath)).stem, 0))  # stable: order kept within
    if "nightly" not in (config.option.markexpr or ""):
        nightly = [item for item in items if item.get_closest_marker("nightly")]
        if nightly:
            config.hook.pytest_deselected(items=nightly)
            items[:] = [item for item in items if not item.get_closest_marker("nightly")]


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
    """Spawned gloo worlds of 2, 3, 4 (and 8) ranks, started on first use and reused."""
    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="module", autouse=True)
def _pools_idle_between_modules(pools):
    """After each module, the pools drop what they held for it (``Pools.idle``; a ``Pools``
    starts no process until its first use)."""
    yield
    pools.idle()
