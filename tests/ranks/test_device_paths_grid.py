"""Where GPU-only code puts its tensors, on the rank pool: the step benchmark's grids are
built on the job's device (on the CPU here, the decision checked with a CUDA device
asked for). (The single-process decisions: tests/unit/test_device_paths.py.)"""

import host_cases


def test_the_step_benchmarks_grids_are_on_the_jobs_device(pools):
    devices = pools.run(2, host_cases.step_grid_devices, spatial=(2, 1, 1))
    assert devices == [["cuda:0", "cuda:0"]] * 2
