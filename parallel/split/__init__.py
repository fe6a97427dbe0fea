"""Tensors split in space: halo exchange, the halo shell, scatter/gather, layouts."""
