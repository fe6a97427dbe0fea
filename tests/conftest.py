"""Shared fixtures, and the test tiers.

A test's tier is the folder it lives in (a pytest marker of the same name;
``scripts/test.sh -m unit`` runs one tier):

- ``tests/unit``: pure logic and single-process work on real files, no spawned ranks; the
  whole tier runs in about a minute.
- ``tests/ranks``: several gloo ranks of the rank pool (``tests/support/harness.py``).
- ``tests/launch``: jobs of the entry points (``python -m cosmoflow.train`` ...) and real
  launches. Jobs that prove numbers (equivalence, cases, resume across grids, K-FAC,
  user models, predict, runs, schedules) run on the session's job pool
  (``tests/support/jobpool.py``: rank processes that imported torch once, each job given
  torchrun's variables, its argv, cwd and output; ``train_helpers.launch``/``python_m``);
  what is about the launcher or the process itself (torchrun, mpirun, Slurm, kills, exit
  codes of dying ranks, scripts) starts real processes; ``scripts/benchmark.py`` runs as
  ``__main__`` in the test's process (``tests/support/bench_cli.py``), its ranks new
  processes as ever, and only its SIGTERM test starts it for real. Generated data sets are made once
  per session and shared read-only (``train_helpers.prepare``; a test that changes files
  takes ``prepare_copy``).
- ``tests/support``: the helpers (rank functions ``*_cases.py``, the pools, the Slurm
  cluster, fixture data); on ``sys.path`` for the tests and their rank processes.

``slow`` marks, besides, the longest launches (``SLOW``: 40 s or more each on a loaded
2-core machine); ``-m "not slow"`` leaves them out.

``nightly`` (not in CI, not in a plain run: ``scripts/test.sh -m nightly`` runs it) holds
only repeats of what CI proves elsewhere, each named in ``NIGHTLY`` with the CI test that
carries its proof.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "support"))

TIER_NAMES = ("unit", "ranks", "launch")

SLOW = {
    "launch/test_cluster_scripts.py::test_documented_weak_scaling_submission",
    "launch/test_elastic.py::test_a_node_dies_and_the_job_finishes_on_the_survivors",
    "launch/test_elastic.py::test_a_node_dies_and_the_cosmoflow_job_finishes_on_the_survivors",
    "launch/test_fail_checkpoint.py::test_kill_during_checkpoint_write_then_resume",
    "launch/test_fail_ranks.py::test_kill_one_of_four_ranks_stops_the_job",
    "launch/test_kfac_train.py::test_kfac_stopped_at_one_grid_resumes_at_another",
    "launch/test_launchers.py::test_each_launcher_at_4_ranks_equals_plain_python",
    "launch/test_predict.py::test_cosmoflow_predict_rows_equal_at_every_grid",
    "launch/test_predict.py::test_unet_predict_says_what_it_read_and_refuses_user_errors_in_one_line",
    "launch/test_mlperf_run.py::test_a_short_closed_run_over_168_42_cases_logs_every_key_the_rules_ask_for",
    "launch/test_schedule_loop.py::test_the_loop_sets_the_reference_rate_at_every_step",
    "launch/test_slurm_real.py::test_strong_submission_and_a_repeated_job_id",
    "launch/test_slurm_real.py::test_scancel_mid_run_leaves_a_usable_checkpoint_and_a_resubmission_resumes",
    "launch/test_slurm_real.py::test_time_limit_warning_checkpoints_and_the_next_submission_resumes_to_the_same_weights",
    "launch/test_train_cases.py::test_cases_of_six_shapes_train_alike_at_every_grid_reading_only_their_share",
    "launch/test_train_cases.py::test_a_crop_or_case_the_network_cannot_take_stops_before_training",
    "launch/test_resume_grid.py::test_stop_at_one_grid_resume_at_others",
    "launch/test_train_runs.py::test_a_used_run_dir_is_refused_overwritten_aside_or_resumed",
    "launch/test_train_sweeps.py::test_sweep_gives_each_job_its_run_dir_and_a_table",
    "launch/test_train_sweeps.py::test_submitit_launcher_starts_each_jobs_ranks",
}

# The longest modules first (seconds on a quiet 2-core machine, run alone), so that
# pytest-xdist's scheduling by group (scripts/test.sh: -n 2 --dist loadgroup; a group is a
# file, or the whole ranks tier) starts them early instead of leaving one of them alone at
# the end; the rest keep their order.
LONGEST_FIRST = {
    "launch/test_slurm_real": 121, "launch/test_docs_commands": 70, "ranks/test_monai": 66,
    "launch/test_cluster_scripts": 60, "launch/test_contract_matrix": 55, "launch/test_elastic": 49,
    "launch/test_benchmark": 45, "launch/test_train_cases": 25, "launch/test_train_sweeps": 25,
    "launch/test_launchers": 22, "launch/test_gpu_check": 21, "launch/test_jobpool": 19, "unit/test_watchdog": 18,
    "launch/test_fail_ranks": 18,
}

NIGHTLY = {
    # the nightly test (or one case of it: name[id]) -> the CI test that carries the same proof
    "ranks/test_monai.py::test_network_equals_its_serial_self[VNet-S122]":
        "ranks/test_monai.py::test_network_equals_its_serial_self[VNet-D2] (VNet's layers split: 5^3 convolutions, "
        "strided and transposed 2^3 convolutions, BatchNorm, the skip concatenations) and the split in two dims at "
        "once for those layers: ranks/test_layers.py (k3-corners-1x2x2, k5-pad2-W4-halo-wider-than-block, "
        "k3-stride2-1x2x2 transposed) and every other network's S122 case (UNet, BasicUNet, SegResNet ...)",
    "ranks/test_monai.py::test_network_equals_its_serial_self[DenseNet121-S122]":
        "ranks/test_monai.py::test_network_equals_its_serial_self[DenseNet121-D2] (DenseNet's layers split: dense "
        "concatenations, BatchNorm, the average-pool transitions, the global pool before the head) and "
        "[resnet10-S122], [resnet18-S122] (BatchNorm, max pool, the global pool and Linear head at two split dims)",
    "ranks/test_monai.py::test_network_equals_its_serial_self[DenseNet121-data2]":
        "ranks/test_monai.py::test_network_equals_its_serial_self[DenseNet121-D2] (its layers split) and "
        "[resnet10-data2], [resnet18-data2] (BatchNorm per data group, the global pool and head at data 2)",
    "launch/test_elastic.py::test_a_node_dies_and_the_cosmoflow_job_finishes_on_the_survivors":
        "launch/test_elastic.py::test_a_node_dies_and_the_job_finishes_on_the_survivors (the elastic path: the U-Net "
        "at spatial 2, data 2 -> 1, accumulation 2; the loop is shared); CosmoFlow's accumulation and clipping equal "
        "serial: launch/test_contract_matrix.py::test_cosmoflow_sgd_options_equal_serial_in_float64; its resume at "
        "another grid: launch/test_resume_grid.py::test_stop_at_one_grid_resume_at_others",
    "launch/test_cluster_scripts.py::test_sbatch_strong_scaling_two_runs":
        "launch/test_slurm_real.py::test_strong_submission_and_a_repeated_job_id (run.sub through a real sbatch and "
        "srun, NEXP=2 runs in a row with their seeds, collected and checked) and "
        "launch/test_slurm_real.py::test_weak_submission_on_two_nodes (two nodes, --relative)",
    "launch/test_public_api.py::test_public_api_program_exits_cleanly_20_times":
        "launch/test_public_api.py::test_public_api_program_exits_cleanly (one run per launcher)",
    "launch/test_gpu_check.py::test_gpu_check_cpu_dry_run_whole":
        "launch/test_gpu_check.py::test_gpu_check_cpu_dry_run_passes (the script, its self-checks and probe); its "
        "nested layer tests are the ranks tier's own; its bf16 train/resume/predict steps on the CPU: "
        "launch/test_train_resume.py::test_gradient_accumulation_matches_and_bf16_runs, "
        "launch/test_contract_matrix.py (bf16), "
        "launch/test_fail_checkpoint.py::test_kill_during_checkpoint_write_then_resume, launch/test_predict.py",
    "launch/test_train_staging.py::test_training_stages_read_once_and_checks_the_copy":
        "ranks/test_data_staging_once.py (read-once staging on 4 ranks as 2 nodes: bytes read once, every copy "
        "checked, resume) and launch/test_train_resume.py::test_outputs_and_checkpoint_loads_serially (the MLPerf "
        "staging events around build_data); the loop passes data.stage_read_once to stage (parallel/train/data.py)",
    "launch/test_replica_faults.py::test_a_bit_flipped_in_a_replicated_weight_of_the_spatial_group_is_caught":
        "launch/test_replica_faults.py::test_a_bit_flipped_in_one_data_replica_is_caught_and_its_rank_named (a flip "
        "in a weight replicated over the spatial group and the data groups, caught at the next check, the checkpoint "
        "before it kept) and unit/test_replicas.py::test_the_odd_rank_of_a_majority_is_named_and_a_pair_names_both "
        "(two copies: both ranks named)",
    "launch/test_replay_step.py::test_a_flipped_bit_in_a_gradient_is_transient_and_the_run_ends_undisturbed":
        "launch/test_replay_step.py::test_a_bad_sample_gives_the_same_numbers_twice_and_is_named (a suspicious step "
        "abandoned before its update, its state put back and run again with the same batch; the verdict from the "
        "numbers gathered over the ranks)",
    "launch/test_hosts_netns.py::test_a_slow_lossy_link_changes_no_weight_and_shows_in_the_step_times":
        "launch/test_hosts_netns.py::test_a_link_taken_down_mid_run_ends_the_job_naming_the_host (the same job, "
        "spatial 2x1x1 across the two hosts' link); that timing never changes the numbers: "
        "launch/test_contract_matrix.py (every grid ends at serial's weights)",
    "launch/test_hosts_netns.py::test_mpirun_across_hosts_equals_one_host_and_a_cut_link_ends_it":
        "launch/test_hosts_netns.py::test_a_link_taken_down_mid_run_ends_the_job_naming_the_host (a job across the "
        "hosts, its link cut: the same watchdog messages) and launch/test_launchers.py::"
        "test_each_launcher_at_4_ranks_equals_plain_python (mpirun's job equals plain python's)",
    "launch/test_hosts_netns.py::test_elastic_survivors_go_on_after_a_link_is_cut":
        "launch/test_elastic.py::test_a_node_dies_and_the_job_finishes_on_the_survivors (the survivors re-grid, "
        "resume and finish) and launch/test_hosts_netns.py::test_a_link_taken_down_mid_run_ends_the_job_naming_the_host "
        "(a cut link ends the session on both sides)",
    "launch/test_hosts_netns.py::test_srun_across_hosts_equals_one_host_and_a_cut_link_ends_it":
        "launch/test_slurm_real.py (srun and sbatch on the real Slurm's two nodes) and "
        "launch/test_hosts_netns.py::test_a_link_taken_down_mid_run_ends_the_job_naming_the_host (a job across the "
        "hosts, its link cut: the same watchdog messages)",
    "launch/test_slurm_real.py::test_weak_submission_on_two_nodes[each]":
        "launch/test_slurm_real.py::test_weak_submission_on_two_nodes[once] (the same weak submission on two nodes, "
        "--relative, collected, checked and its staging removed; staged once per job) and "
        "launch/test_slurm_real.py::test_strong_submission_and_a_repeated_job_id (each run staging into its own "
        "STAGE_DIR/spatialcnn_<job>_<instance>_<split> under Slurm, the default)",
}


def _where(item: pytest.Item) -> str:
    """``tier/test_file.py``: the test's path under tests/."""
    return Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test its folder's tier; refuse a test outside the tier folders; leave the
    nightly tier out unless ``-m`` names it."""
    names = {f"{_where(item)}::{n}" for item in items for n in (item.originalname, item.name)}
    files = {n.split("::")[0] for n in names}
    unknown = [n for n in {**NIGHTLY, **dict.fromkeys(SLOW)} if n.split("::")[0] in files and n not in names]
    if unknown:
        raise pytest.UsageError(f"NIGHTLY or SLOW in tests/conftest.py name missing tests: {unknown}")
    misplaced = set()
    grouped = config.pluginmanager.hasplugin("xdist")
    for item in items:
        where = _where(item)
        tier = where.split("/")[0]
        if tier not in TIER_NAMES:
            misplaced.add(where)
            continue
        if any(m.name in TIER_NAMES for m in item.own_markers):
            raise pytest.UsageError(f"{item.nodeid} carries a tier marker: its folder (tests/{tier}) sets the tier")
        item.add_marker(getattr(pytest.mark, tier))
        # pytest-xdist (scripts/test.sh: --dist loadgroup): the whole ranks tier on one worker, so
        # one set of rank pools serves it; every other file whole on one worker (its module
        # fixtures, the real Slurm cluster, stay within it)
        if grouped:
            item.add_marker(pytest.mark.xdist_group("ranks" if tier == "ranks" else where))
        if f"{where}::{item.originalname}" in NIGHTLY or f"{where}::{item.name}" in NIGHTLY:
            item.add_marker(pytest.mark.nightly)
        if f"{where}::{item.originalname}" in SLOW:
            item.add_marker(pytest.mark.slow)
    if misplaced:
        raise pytest.UsageError(f"test file(s) {', '.join(sorted(misplaced))} lie outside the tier folders: move them "
                                f"into tests/{{{','.join(TIER_NAMES)}}}/")
    items.sort(key=lambda item: -LONGEST_FIRST.get(_where(item).removesuffix(".py"), 0))  # stable: order kept within
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
    from harness import Pools  # loaded on use: collecting alone (tests/unit/test_tiers.py) imports no torch

    p = Pools()
    yield p
    p.close()


@pytest.fixture(scope="module", autouse=True)
def _pools_idle_between_modules(request, pools):
    """After each module, the pools drop what they held for it (``Pools.idle``; a ``Pools``
    starts no process until its first use). The ranks tier runs on one worker, module after
    module, and keeps its 8-rank world between them (starting 8 ranks costs seconds of CPU
    on 2 cores); a module of another tier ends it first."""
    ranks = _where(request.node).split("/")[0] == "ranks"
    if not ranks:
        pools.idle()
    yield
    pools.idle(keep=8 if ranks else 4)
