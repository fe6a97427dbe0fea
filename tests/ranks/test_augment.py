"""Augmenting a split volume equals augmenting the whole volume."""

from __future__ import annotations

import pytest
import torch

import augment_cases

FLIPS = [  # (world, spatial, global shape (N, C, D, H, W), dims)
    (3, [3, 1, 1], (2, 2, 19, 4, 5), (2,)),           # uneven: blocks 7, 6, 6 mirror onto 6, 6, 7
    (3, [3, 1, 1], (1, 1, 19, 4, 5), (2, 3, 4)),
    (4, [2, 2, 1], (2, 1, 9, 7, 4), (2, 3)),
    (4, [1, 2, 2], (3, 2, 4, 10, 9), (3, 4)),
    (4, [1, 1, 1], (4, 1, 5, 5, 5), (4,)),            # data groups only: a local flip
]


@pytest.mark.parametrize("world,spatial,shape,dims", FLIPS)
def test_flip_of_blocks_is_flip_of_volume(pools, world, spatial, shape, dims):
    pools.run(world, augment_cases.check_flip, shape, dims, spatial=spatial)


SHAPE = (4, 1, 12, 10, 9)
EVERYTHING = {"flip_prob": 0.5, "brightness_prob": 0.5, "noise_prob": 0.5}


def test_unet_augmentation_is_the_same_at_every_grid(pools):
    serial = pools.run(1, augment_cases.unet_augment, SHAPE, EVERYTHING, 11)[0]
    assert not torch.equal(serial["image"], serial["input_image"]), "nothing was augmented"
    for world, spatial in [(4, [2, 1, 1]), (4, [1, 2, 2]), (2, [1, 1, 1])]:  # data 2 x spatial 2, ...
        for got in pools.run(world, augment_cases.unet_augment, SHAPE, EVERYTHING, 11, spatial=spatial):
            torch.testing.assert_close(got["image"], serial["image"], rtol=1e-6, atol=1e-6)
            assert torch.equal(got["label"], serial["label"]), f"labels differ at spatial {spatial}"


def test_unet_flips_move_image_and_label_together(pools):
    only_flips = {"flip_prob": 1.0, "brightness_prob": 0.0, "noise_prob": 0.0}
    for got in pools.run(4, augment_cases.unet_augment, SHAPE, only_flips, 3, spatial=[2, 2, 1]):
        assert torch.equal(got["image"], got["input_image"].flip(2, 3, 4))
        assert torch.equal(got["label"], got["input_label"].flip(1, 2, 3))
    off = {"flip_prob": 0.0, "brightness_prob": 0.0, "noise_prob": 0.0}
    got = pools.run(2, augment_cases.unet_augment, SHAPE, off, 3, spatial=[2, 1, 1])[0]
    assert torch.equal(got["image"], got["input_image"])
