"""Networks a user brings train through the shared loop with ``model._target_=...``.

A MONAI SegResNet trains on the synthetic U-Net set through ``unet3d.train``, split in
space at two grids; its checkpoint is a plain SegResNet's
``state_dict`` (``torch.load(weights_only=True)``, ``load_state_dict(strict=True)``),
whose serial outputs give the validation numbers the split run logged, and both grids
end with the same weights. A MONAI DenseNet regresses CosmoFlow's four parameters
through ``cosmoflow.train``. A network that resizes with ``F.interpolate`` in its own
forward is stopped before the first step by ``parallel.verify`` (exit 2), naming the
module. Real processes (the session's job pool), real files; ``user_models`` is on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import pytest
import torch

from train_helpers import env, launch, max_rel_diff, prepare, weights

TESTS = Path(__file__).resolve().parents[1] / "support"
SEGRESNET = dict(init_filters=8, out_channels=3, blocks_down=[1, 1], blocks_up=[1])
COMMON = ["--config-name", "quickstart", "train.global_batch_size=2", "train.max_steps=3", "train.seed=5",
          "train.eval_every=0", "train.eval_at_end=true", "eval.mode=whole", "optim.lr=0.05",
          "run.progress=false", "run.tensorboard=false"]


def _overrides(kwargs: dict, target: str) -> list[str]:
    return [f"model._target_={target}"] + [f"model.{k}={json.dumps(v).replace(' ', '')}" for k, v in kwargs.items()]


@pytest.fixture(scope="module")
def unet_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare("unet3d", tmp_path_factory.mktemp("unet16"), 16, 8, 2)


@pytest.fixture(scope="module")
def segresnet_runs(unet_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """Trains (once per grid, on first use) and returns the run directory and the log."""
    root, done = tmp_path_factory.mktemp("segresnet"), {}

    def run(spatial: str) -> tuple[Path, str]:
        if spatial not in done:
            out = root / spatial.strip("[]").replace(",", "x")
            proc = launch("unet3d", 2, [*COMMON, *_overrides(SEGRESNET, "monai.networks.nets.SegResNet"),
                                        f"data.dir={unet_data}", f"run.dir={out}", f"parallel.spatial={spatial}"])
            done[spatial] = (out, proc.stdout + proc.stderr)
        return done[spatial]

    return run


def _serial_eval(model: torch.nn.Module, val_dir: Path) -> tuple[float, float]:
    """The U-Net family's validation loss and mean Dice of ``model``, serially, file by file."""
    from unet3d.family import FAMILY
    from unet3d.fields import transform

    losses, dice = [], []
    for path in sorted(val_dir.glob("*.h5")):
        with h5py.File(path, "r") as f:
            for i in range(f["image"].shape[0]):
                sample = transform({"image": torch.from_numpy(f["image"][i]), "label": torch.from_numpy(f["label"][i])})
                x, y = sample["image"][None], sample["label"][None]
                with torch.no_grad():
                    out = model(x)
                losses.append(float(FAMILY.loss(out, y, None)))
                dice.append(float(FAMILY.metric(out, y, None)[0]))
    return sum(losses) / len(losses), sum(dice) / len(dice)


@pytest.mark.parametrize("spatial", ["[2,1,1]", "[1,2,1]"])
def test_monai_segresnet_trains_split_and_loads_into_a_plain_segresnet(segresnet_runs, unet_data, spatial):
    from monai.networks.nets import SegResNet

    run_dir, log = segresnet_runs(spatial)
    assert "parallel.verify: checked before the first step" in log, log[-3000:]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    plain = SegResNet(**SEGRESNET)
    plain.load_state_dict(state, strict=True)
    plain.eval()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r["kind"] == "eval"][-1]
    loss, dice = _serial_eval(plain, unet_data / "val")
    # float32 sums in another order: ~1e-6 relative on the loss; the Dice of argmax
    # predictions may move by a voxel whose two largest logits are within that rounding
    assert loss == pytest.approx(logged["val_loss"], rel=1e-5), (loss, logged)
    assert dice == pytest.approx(logged["val_mean_dice"], abs=1e-3), (dice, logged)


def test_segresnet_runs_at_two_grids_end_with_the_same_weights(segresnet_runs):
    d2, _ = segresnet_runs("[2,1,1]")
    h2, _ = segresnet_runs("[1,2,1]")
    diff, key = max_rel_diff(weights(d2), weights(h2))
    assert diff < 1e-4, f"{key} differs by {diff:.2e} relative between spatial 2x1x1 and 1x2x1"


def test_monai_densenet_regresses_cosmoflow_parameters(tmp_path_factory: pytest.TempPathFactory):
    from monai.networks.nets import DenseNet

    data = prepare("cosmoflow", tmp_path_factory.mktemp("cosmo16"), 16, 8, 4)
    root = tmp_path_factory.mktemp("densenet")
    net = dict(spatial_dims=3, in_channels=4, out_channels=4, init_features=8, growth_rate=4, block_config=[2, 2])
    common = ["--config-name", "quickstart", f"data.dir={data}", "train.global_batch_size=4", "train.max_steps=2",
              "run.progress=false", "run.tensorboard=false", *_overrides(net, "monai.networks.nets.DenseNet")]
    proc = launch("cosmoflow", 2, [*common, f"run.dir={root / 'split'}", "parallel.spatial=[2,1,1]"])
    assert "parallel.verify: checked before the first step" in proc.stdout + proc.stderr
    summary = json.loads((root / "split" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["metric"] == "val_mae" and summary["best_metric"] > 0
    plain = DenseNet(**net)
    plain.load_state_dict(torch.load(root / "split" / "checkpoints" / "last.pt", weights_only=True)["model"],
                          strict=True)
    # BatchNorm's running statistics (buffers of the state_dict) follow the serial run's too
    launch("cosmoflow", 1, [*common, f"run.dir={root / 'serial'}", "parallel.spatial=[1,1,1]"])
    serial, split = weights(root / "serial"), weights(root / "split")
    assert any("running_var" in k for k in serial)
    diff, key = max_rel_diff(serial, split)
    assert diff < 1e-4, f"{key} differs by {diff:.2e} relative between the serial and the split run"


def test_a_functional_resize_is_stopped_by_verification_naming_the_module(unet_data, tmp_path):
    e = {"PYTHONPATH": f"{TESTS}{os.pathsep}{env()['PYTHONPATH']}"}
    proc = launch("unet3d", 2, [*COMMON, "model._target_=user_models.InterpolatingSegNet", f"data.dir={unet_data}",
                                f"run.dir={tmp_path / 'run'}", "parallel.spatial=[2,1,1]"], check=False, extra_env=e)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    line = next((ln for ln in text.splitlines() if "verification failed" in ln), "")
    assert "[rank 0]" in line and "the output of module 'up' (Resize) differs" in line, text[-3000:]
    assert "F.interpolate on a split tensor" in line and "parallel.verify=false" in line, line
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()  # stopped before the first step
