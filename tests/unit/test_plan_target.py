"""Time to the target: the S(B) fit, its file beside the calibration, and the planner's
ranking by predicted steps x step time (``parallel.plan.target``, ``--target``)."""

import json

import pytest

from parallel.plan.target import StepsModel, fit, from_noise_scale, main, rank


def test_fit_recovers_s_min_and_b_noise_and_predicts_held_out_batches():
    truth = StepsModel(s_min=200.0, b_noise=48.0)
    m = fit([[8, truth.steps(8)], [128, truth.steps(128)]])
    assert m.s_min == pytest.approx(200.0, rel=1e-12) and m.b_noise == pytest.approx(48.0, rel=1e-12)
    assert max(abs(e) for e in m.errors([[b, truth.steps(b)] for b in (2, 32, 512)])) < 1e-12
    # four noisy points: least squares in relative terms, none of them fitted exactly
    noisy = fit([[8, truth.steps(8) * 1.05], [16, truth.steps(16) * 0.95], [64, truth.steps(64)],
                 [128, truth.steps(128) * 1.02]])
    assert 0 < max(abs(e) for e in noisy.errors()) < 0.06 and 30 < noisy.b_noise < 70
    with pytest.raises(ValueError, match="two or more batches"):
        fit([[8, 100], [8, 120]])
    with pytest.raises(ValueError, match="do not fall with the batch"):
        fit([[8, 100], [64, 300]])  # more steps at the larger batch


def test_one_batch_and_the_measured_noise_scale():
    m = from_noise_scale(16, 300, 16.0)
    assert m.b_noise == 16.0 and m.steps(16) == pytest.approx(300) and m.s_min == pytest.approx(150)


def test_rank_orders_by_steps_times_step_time_and_marks_the_data_parallel_choice():
    m = StepsModel(s_min=100.0, b_noise=64.0)
    rows = [  # at 8 ranks: data parallelism alone grows the batch; a split keeps it
        {"data": 8, "spatial": [1, 1, 1], "global_batch": 8, "step_s": 1.0, "fits": True},
        {"data": 8, "spatial": [1, 1, 1], "global_batch": 64, "step_s": 4.0, "fits": True},
        {"data": 2, "spatial": [4, 1, 1], "global_batch": 8, "step_s": 0.3, "fits": True},
        {"data": 1, "spatial": [8, 1, 1], "global_batch": 8, "step_s": 0.1, "fits": False},
    ]
    out = rank(rows, m)
    assert [r["time_to_target_s"] for r in out] == sorted(r["time_to_target_s"] for r in out)
    best = next(r for r in out if r["best"])
    assert best["spatial"] == [4, 1, 1] and best["time_to_target_s"] == pytest.approx(100 * 9 * 0.3)
    plain = next(r for r in out if r["best_data_only"])
    assert plain["global_batch"] == 64 and plain["steps"] == pytest.approx(200)  # 800 s against 900 s at batch 8
    assert not out[0]["fits"]  # the fastest does not fit: never marked


def test_the_command_writes_the_fit_and_the_planner_ranks_by_it(tmp_path, capsys):
    path = tmp_path / "target.json"
    assert main(["--point", "16:900", "64:400", "--source", "test", "--out", str(path)]) == 0
    stored = json.loads(path.read_text())
    assert stored["b_noise"] == pytest.approx(320 / 7) and "linearly" in stored["lr_rule"]
    assert main(["--point", "16:900", "--out", str(tmp_path / "x.json")]) == 2  # one batch, no B_simple
    assert "two or more batches" in capsys.readouterr().err
    from parallel.plan.cli import main as plan

    capsys.readouterr()
    assert plan(["--model", "cosmoflow", "--size", "32", "--set", "model.n_conv_blocks=4", "--devices", "4",
                 "--batch", "4", "--generic", "cpu", "--target", str(path)]) == 0
    text = capsys.readouterr().out
    assert "fastest to the target" in text and "data-parallel only" in text and "fastest step" in text
    assert "learning-rate rule" in text
    assert plan(["--model", "cosmoflow", "--size", "32", "--devices", "4", "--generic", "cpu",
                 "--target", str(tmp_path / "missing.json")]) == 2


def _run_dir(path, batch, metric, target, evals, b_simple=None):
    path.mkdir()
    (path / "config.yaml").write_text(f"train:\n  global_batch_size: {batch}\n")
    (path / "summary.json").write_text(json.dumps({"metric": metric, "target": target, "status": "success",
                                                   "noise_scale": {"measured": b_simple is not None,
                                                                   "b_simple": b_simple}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "eval", "step": s, metric: v}) + "\n"
                                                for s, v in evals))
    return path


def test_the_command_reads_steps_to_the_target_from_run_dirs(tmp_path, capsys):
    """The first evaluation that reached the target, by the family's goal (CosmoFlow's MAE
    falls, the U-Net's Dice rises), and the runs' B_simple kept beside the fit."""
    a = _run_dir(tmp_path / "a", 8, "val_mae", 0.3, [(100, 0.5), (300, 0.29), (400, 0.2)], b_simple=5.0)
    b = _run_dir(tmp_path / "b", 64, "val_mae", 0.3, [(40, 0.4), (80, 0.3)], b_simple=20.0)
    out = tmp_path / "t.json"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    m = StepsModel.load(out)
    assert m.points == [[8.0, 300.0], [64.0, 80.0]] and m.b_simple == pytest.approx(10.0)
    dice = _run_dir(tmp_path / "d", 4, "val_dice", 0.85, [(16, 0.5), (32, 0.86)])
    assert main([str(dice), "--b-simple", "4", "--out", str(out)]) == 0
    assert StepsModel.load(out).points == [[4.0, 32.0]]
    never = _run_dir(tmp_path / "n", 4, "val_dice", 0.95, [(16, 0.5)])
    assert main([str(never), "--b-simple", "4", "--out", str(out)]) == 2
    assert "did not reach its target" in capsys.readouterr().err
