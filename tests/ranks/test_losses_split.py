"""The U-Net's Dice + cross-entropy loss and its Dice metric reduced across a spatial
split equal the serial ones, values and input gradient, on real gloo ranks."""

import pytest
import torch

from unet3d.losses import dice_ce_loss, dice_per_sample


def _split_loss_case(grid, logits, labels):
    """This rank's block of logits and labels -> reduced loss, metric and input gradient block."""
    from parallel.split.scatter import scatter

    block = scatter(logits, grid).detach().requires_grad_(True)
    lab = scatter(labels[:, None].float(), grid).long()
    loss = dice_ce_loss(block, lab, grid)
    loss.backward()
    return loss.item(), dice_per_sample(block.detach(), lab, grid), block.grad



@pytest.mark.parametrize("spatial", [(2, 1, 1), (1, 2, 2)], ids=["D2", "H2W2"])
def test_dice_ce_split_equals_serial(pools, spatial):
    from parallel.grid import Grid

    torch.manual_seed(1)
    logits = torch.randn(2, 3, 8, 6, 6)
    labels = torch.randint(0, 3, (2, 8, 6, 6))
    world = spatial[0] * spatial[1] * spatial[2]
    results = pools.run(world, _split_loss_case, logits, labels, spatial=spatial)
    x = logits.clone().requires_grad_(True)
    serial = dice_ce_loss(x, labels)
    serial.backward()
    metric = dice_per_sample(logits, labels)
    for rank, (loss, m, grad) in enumerate(results):
        # the reduction order differs from the serial sum: float32 rounding only
        assert loss == pytest.approx(serial.item(), rel=1e-5)
        torch.testing.assert_close(m, metric)
        sl = Grid(spatial, world, rank).block_slices((8, 6, 6))
        torch.testing.assert_close(grad, x.grad[(slice(None), slice(None), *sl)])
