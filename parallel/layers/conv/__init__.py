"""The split convolution and its paths, together.

- ``layer``: ``SpatialConv3d`` and ``SpatialConvTranspose3d``, the layers ``parallelize``
  puts in place of ``nn.Conv3d`` and ``nn.ConvTranspose3d``;
- ``shell``: the shell path, the block convolved in place plus thin corrections for the
  halos (the halo shell's exchange: ``parallel.split.shell``);
- ``paths``: the choice between the shell and the window path (``conv_path``);
- ``kernels``: ``F.conv3d`` and its backward with thin CPU blocks reordered.
"""

from parallel.layers.conv.layer import SpatialConv3d, SpatialConvTranspose3d

__all__ = ["SpatialConv3d", "SpatialConvTranspose3d"]
