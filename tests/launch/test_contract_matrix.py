"""The equivalence matrix: every training option a user can turn on ends where serial ends.

Each composite configuration below turns on several compatible options at once and runs
at four grids: serial, spatial 2x1x1, 2x2x1 and data 2 x spatial 2x1x1 (4 ranks). With
``train.precision=fp64`` the grids end with the serial run's weights to 1e-9 relative
(float64 sums in another order: ~1e-15), so a split that changes the maths by a
float32-noise-sized amount (per-rank gradient clipping, as an earlier version clipped: 1e-2 here) fails.
Low precision (bf16 autocast, fp16 with the loss scaler) cannot run at fp64: see the
last lines; fp16 also compares the loss scale every grid ended with (the skip decision
is global).

| composite | options on |
|---|---|
| ``cosmo_sgd`` | clipping (clipped at every step), accumulation 2, weight-decay groups, activation recompute, sharded Flatten+Linear and replicated Linear, an injected non-finite step skipped, the window conv path, a resume at step 2 (2x1x1) |
| ``cosmo_kfac`` | K-FAC (factors every step, eigendecompositions every 2, KL clip), clipping, weight decay, NDHWC activations, a resume at step 2 (2x2x1) |
| ``unet`` | InstanceNorm, 16^3 crops of larger cases with oversampling, augmentation, sliding-window evaluation (its Dice compared too), accumulation 2, the timed (``auto``) conv path, NDHWC activations, a resume at step 2 (data 2 x spatial 2) |
| ``unet_bn`` | BatchNorm: 2x2x1 against serial (at data 2 each data group normalises over its own share of the batch, as DDP does: not serial's numbers, docs/training.md) |
| ``cosmo_dropout`` | seeded dropout: 2x1x1 against 2x2x1 (not serial: see the test) |
| ``cosmo_fp16`` | fp16 autocast with the loss scaler, clipping, an injected overflow on one spatial rank (serial, 2x1x1, data 2 x spatial 2) |
| ``cosmo_bf16`` | bf16 autocast, the shell convolution's low-precision sums, clipping, a skipped step (serial, 2x2x1) |

Low precision is compared with its own rounding: a split run must end no further from its
serial run than that serial run ends from the float32 serial run (``cosmo_fp32``).
"""



import json
from pathlib import Path

import pytest
import torch

from train_helpers import launch, max_rel_diff, prepare, weights

EXACT = 1e-9  # float64 sums in another order over 4 steps: ~1e-15 measured



GRIDS = {"serial": (1, "[1,1,1]"), "s2": (2, "[2,1,1]"), "s2x2": (4, "[2,2,1]"), "d2s2": (4, "[2,1,1]")}



COMMON = ["--config-name", "quickstart", "train.max_steps=4", "train.seed=3", "train.eval_every=0",
          "run.progress=false", "run.tensorboard=false", "run.log_rank=-3", "mlperf.enabled=false",
          "sched.warmup_epochs=0", "optim.lr=0.05"]



COSMO = ["model.conv_filters=4", "model.n_conv_blocks=3", "model.dense_sizes=[16,8]", "model.input_shift=3.8",
         "model.input_scale=2.0", "train.global_batch_size=4", "train.eval_at_end=false"]



CASES = {
    "cosmo_sgd": ("cosmoflow", [*COSMO, "train.precision=fp64", "train.grad_clip=0.05", "train.accum_steps=2",
                                "optim.weight_decay=0.01", "model.dropout=0.0",
                                "train.activation_checkpointing=true", "train.nonfinite=skip",
                                "train.inject_nonfinite=[2]", "parallel.conv_path=window"]),
    "cosmo_dropout": ("cosmoflow", [*COSMO, "train.precision=fp64", "model.dropout=0.3"]),
    "cosmo_kfac": ("cosmoflow", [*COSMO, "train.precision=fp64", "model.dropout=0.0", "optim.name=kfac",
                                 "optim.kfac.factor_interval=1", "optim.kfac.inverse_interval=2",
                                 # float32 factors round at 1e-4 after 4 steps: fp64 needs them in float64
                                 "optim.kfac.factor_dtype=float64", "optim.kfac.inverse_dtype=float64",
                                 "train.grad_clip=0.5", "optim.weight_decay=0.01",
                                 "parallel.channels_last=true"]),
    "unet": ("unet3d", ["train.precision=fp64", "model.depth=2", "model.base_filters=4", "model.max_filters=8",
                        "data.crop=[16,16,16]", "data.oversampling=0.5",
                        "train.global_batch_size=4", "train.accum_steps=2", "train.eval_at_end=true",
                        "eval.mode=sliding", "augment.flip_prob=0.5", "augment.noise_prob=0.5",
                        "parallel.conv_path=auto", "parallel.channels_last=true"]),
    "unet_bn": ("unet3d", ["train.precision=fp64", "model.depth=2", "model.base_filters=4", "model.max_filters=8",
                           "model.norm=batch", "data.crop=[16,16,16]", "train.global_batch_size=4",
                           "train.eval_at_end=false"]),
    **{f"cosmo_{p}": ("cosmoflow", [*COSMO, f"train.precision={p}", "model.dropout=0.0", "train.grad_clip=0.05",
                                   "train.nonfinite=skip", "train.inject_nonfinite=[2]"])
       for p in ("fp32", "fp16", "bf16")},
}



RESUME_AT = {"cosmo_sgd": "s2", "cosmo_kfac": "s2x2", "unet": "d2s2"}  # stopped after step 2, resumed



@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("contract_data")
    return {"cosmoflow": prepare("cosmoflow", root / "cosmoflow", 16, 8, 2),
            "unet3d": _prepare_unet(root / "unet3d")}



def _prepare_unet(out: Path) -> Path:
    """Cases of 20..28 voxels per side: 16^3 crops land in different places."""
    from train_helpers import python_m

    if not (out / "val" / "manifest.json").exists():
        made = python_m("unet3d.prepare", ["synthetic", "--out", str(out), "--size-range", "20,28", "--crop", "16",
                                           "--train", "8", "--val", "2", "--quiet", "--workers", "1"], timeout=240)
        assert made.returncode == 0, made.stderr[-3000:]
    return out



def _run(case: str, grid: str, data: dict[str, Path], root: Path, extra: tuple[str, ...] = ()) -> Path:
    model, options = CASES[case]
    nproc, spatial = GRIDS[grid]
    out = root / f"{case}_{grid}"
    args = [*COMMON, f"data.dir={data[model]}", *options, f"parallel.spatial={spatial}", f"run.dir={out}", *extra]
    if RESUME_AT.get(case) == grid:  # stop after step 2, then resume to the end
        launch(model, nproc, [*args, "train.max_steps=2"], timeout=300)
        launch(model, nproc, [*args, "train.resume=true"], timeout=300)
    else:
        launch(model, nproc, args, timeout=300)
    return out



def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())



def _exact(case: str, data: dict[str, Path], root: Path) -> dict[str, Path]:
    """Run ``case`` at the four grids; assert the split runs end at serial's weights to 1e-9."""
    runs = {g: _run(case, g, data, root) for g in GRIDS}
    for grid in ("s2", "s2x2", "d2s2"):
        ref = "serial"
        a, b = weights(runs[ref]), weights(runs[grid])
        assert all(v.dtype == torch.float64 for v in a.values() if v.is_floating_point()), "fp64 weights"
        diff, key = max_rel_diff(a, b)
        assert diff < EXACT, f"{case} at {grid}: {key} differs from {ref} by {diff:.2e} relative"
    return runs



def test_cosmoflow_sgd_options_equal_serial_in_float64(data, tmp_path):
    runs = _exact("cosmo_sgd", data, tmp_path)
    for grid, run in runs.items():
        s = _summary(run)
        assert s["skipped_steps"] == 1, (grid, s["skipped_steps"])  # the injected NaN: skipped everywhere
        # 3 updates, each clipped (clipping active); the resumed run's second session made 2 of them
        assert s["clipped_steps"] == (2 if grid == "s2" else 3), (grid, s["clipped_steps"])
        # every split convolution ran the window path (serial has none: nothing is split)
        assert (s["conv_paths"] == {}) if grid == "serial" else (set(s["conv_paths"]) == {"window"}), (grid, s)



def test_cosmoflow_kfac_equals_serial_in_float64(data, tmp_path):
    runs = _exact("cosmo_kfac", data, tmp_path)
    for grid, run in runs.items():  # clipping active at every step (the resumed run's 2nd session: 2)
        assert _summary(run)["clipped_steps"] == (2 if grid == "s2x2" else 4), grid
    assert torch.load(runs["s2x2"] / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["kfac"]["steps"] == 4
    assert all(_summary(r)["channels_last"] is True for r in runs.values())  # K-FAC's factors from NDHWC activations



def test_unet_crops_and_sliding_window_equal_serial_in_float64(data, tmp_path):
    runs = _exact("unet", data, tmp_path)
    serial = _summary(runs["serial"])
    assert 0.0 < serial["best_metric"] < 1.0
    for grid in ("s2", "s2x2", "d2s2"):
        got = _summary(runs[grid])["best_metric"]
        assert got == pytest.approx(serial["best_metric"], rel=EXACT, abs=0), grid
        # auto timed each split convolution's two paths (trial forwards and backwards that must
        # leave no trace in the weights) and took one of them
        paths = _summary(runs[grid])["conv_paths"]
        assert paths and set(paths) <= {"shell", "window"}, (grid, paths)
        assert _summary(runs[grid])["channels_last"] is True, grid



def test_batchnorm_split_in_space_equals_serial_in_float64(data, tmp_path):
    runs = {g: _run("unet_bn", g, data, tmp_path) for g in ("serial", "s2x2")}
    diff, key = max_rel_diff(weights(runs["serial"]), weights(runs["s2x2"]))
    assert diff < EXACT, f"BatchNorm at 2x2x1: {key} differs from serial by {diff:.2e} relative"
    assert any("running_mean" in k for k in weights(runs["serial"])), "a BatchNorm model"



def test_seeded_dropout_is_the_same_at_every_spatial_split(data, tmp_path):
    # Split runs draw dropout masks from a generator per spatial group (parallel.parallelize);
    # serial runs keep torch's nn.Dropout on the global stream, so they differ from serial
    # (0.87 relative after 4 steps at p=0.3: docs/training.md) until that stream follows serial's
    runs = {g: _run("cosmo_dropout", g, data, tmp_path) for g in ("s2", "s2x2")}
    diff, key = max_rel_diff(weights(runs["s2"]), weights(runs["s2x2"]))
    assert diff < EXACT, f"dropout at 2x1x1 vs 2x2x1: {key} differs by {diff:.2e} relative"



def test_low_precision_is_no_further_from_serial_than_its_own_rounding(data, tmp_path):
    # fp16 at two grids, bf16 at the third (suite time). The yardstick of each precision is
    # its own rounding: how far its serial run ends from the float32 serial run (measured:
    # bf16 2.8e-3, fp16 4.8e-4; the split runs 4.2e-4 and 3.9e-5 from their serial runs)
    runs = {("fp32", "serial"): _run("cosmo_fp32", "serial", data, tmp_path)}
    for precision, grids in (("fp16", ("serial", "s2", "d2s2")), ("bf16", ("serial", "s2x2"))):
        runs.update({(precision, g): _run(f"cosmo_{precision}", g, data, tmp_path) for g in grids})
    ckpt = {k: torch.load(r / "checkpoints" / "last.pt", weights_only=True) for k, r in runs.items()}
    # parallel.channels_last=auto (the default): NDHWC on CPUs at float32 only, where it was measured faster
    assert {k: _summary(r)["channels_last"] for k, r in runs.items()} == {k: k[0] == "fp32" for k in runs}
    for precision in ("fp16", "bf16"):
        serial = ckpt[(precision, "serial")]
        rounding, _ = max_rel_diff(ckpt[("fp32", "serial")]["model"], serial["model"])
        for (p, grid), c in ckpt.items():
            if p != precision or grid == "serial":
                continue
            diff, key = max_rel_diff(serial["model"], c["model"])
            assert diff < rounding, (f"{precision} at {grid}: {key} differs from serial by {diff:.2e}, more than "
                                     f"serial {precision} from serial fp32 ({rounding:.2e})")
            if precision == "fp16":  # the injected NaN halved the scale once, on every rank alike
                assert c["scaler"]["scale"] == serial["scaler"]["scale"] == 2.0**15, (grid, c["scaler"])
            assert _summary(runs[(p, grid)])["skipped_steps"] == (0 if p == "fp16" else 1)



def test_the_bf16_selfcheck_passes_at_two_ranks_on_the_path_every_device_takes():
    import subprocess

    from train_helpers import BIN, REPO, env

    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "parallel.verify.selfcheck",
           "--spatial", "2", "1", "1", "--precision", "bf16"]
    proc = subprocess.run(cmd, env=env(), cwd=REPO, timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # summed in bf16 as GPUs once did: 0.149 against 0.05; summed in float32 from rounded inputs: ~0.015
    assert report["ok"] and report["max_rel_diff"] <= report["tolerance"] / 2, report
