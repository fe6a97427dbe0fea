"""``python -m parallel.data stage``: what it refuses, in one line naming the input, before
any process group starts (its staging runs on the real Slurm's two nodes:
tests/launch/test_slurm_real.py::test_weak_submission_on_two_nodes)."""

from __future__ import annotations

import logging

import pytest

from parallel.data.__main__ import _pairs, main


def test_bad_source_or_split_is_named_and_ends_with_status_2(tmp_path, caplog):
    (tmp_path / "src" / "train").mkdir(parents=True)
    with caplog.at_level(logging.ERROR):
        assert main(["stage", str(tmp_path / "missing"), str(tmp_path / "dest")]) == 2
        assert main(["stage", str(tmp_path / "src"), str(tmp_path / "dest"), "--split", "val=nope"]) == 2
        assert main(["stage", str(tmp_path / "src"), str(tmp_path / "dest"), "--split", "a/b=train"]) == 2
    text = caplog.text
    assert f"SRC {tmp_path / 'missing'} is not a directory" in text
    assert f"--split val=nope: {tmp_path / 'src' / 'nope'} is not a directory" in text
    assert "--split 'a/b=train': give NAME or NAME=SUBDIR" in text


def test_splits_map_source_folders_to_destination_folders(tmp_path):
    for d in ("train", "val"):
        (tmp_path / "src" / d).mkdir(parents=True)
    src, dest = tmp_path / "src", tmp_path / "dest"
    assert _pairs(src, dest, []) == [("train", src / "train", dest / "train"), ("val", src / "val", dest / "val")]
    assert _pairs(src, dest, ["train", "val=train"]) == [("train", src / "train", dest / "train"),
                                                         ("val", src / "train", dest / "val")]
    assert _pairs(src / "train", dest, []) == [("", src / "train", dest)]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        _pairs(src, dest, ["test"])


def test_a_copy_counts_as_held_only_for_the_source_file_it_came_from(tmp_path):
    """Two splits' folders hold files of the same names: a copy staged from val/ is not
    train/'s (read-once staging would skip fetching it and train on the wrong samples)."""
    import hashlib

    from parallel.data.readonce import _held, _source_id, _write

    data = b"sample bytes"
    sha = hashlib.sha256(data).hexdigest()
    train, val = tmp_path / "train" / "s0.h5", tmp_path / "val" / "s0.h5"
    _write(tmp_path / "dest", "s0.h5", data, sha, None, _source_id(val))
    assert _held(tmp_path / "dest", {"s0.h5": _source_id(train)}, None) == {}
    assert _held(tmp_path / "dest", {"s0.h5": _source_id(val)}, None) == {"s0.h5": [len(data), sha]}
