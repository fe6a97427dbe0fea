"""Named multi-GPU machines for the planner: a node's GPUs, their memory and speed, the
links inside a node and between nodes, and the storage a node reads from.

Why: ``Machine`` describes one rank and one network; a cluster has two networks (NVLink
inside a node, InfiniBand between nodes), and which one a split's messages cross depends
on the split. ``machine_for`` gives the ``Machine`` of one (data x spatial) split: a
spatial group within one node exchanges halos over NVLink, a larger one over its GPUs'
share of the node's InfiniBand; the gradient all-reduce spans the job.

Every figure is a public specification or an assumption, and says which (``NODES``); no
GPU of either kind has run this code. The convolutions' share of peak (``conv_efficiency``)
is an assumption: cuDNN's 3-D convolutions in float32 reach a fraction of the FP32 peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parallel.model.trace import Layer
from parallel.plan.cost import Options, predict
from parallel.plan.machine import Machine


@dataclass(frozen=True)
class Node:
    """One node of a GPU cluster (figures per GPU unless said otherwise)."""

    name: str
    gpus: int
    memory: float                 # bytes of device memory per GPU
    fp32_flops: float             # peak FP32 flop/s per GPU (TF32 off: the framework's default)
    mem_bandwidth: float          # device memory bytes/s
    intra_beta: float             # bytes/s one direction between two GPUs of a node
    inter_beta: float             # bytes/s one direction per GPU between nodes (its share of the node's links)
    intra_alpha: float = 1e-5     # seconds per message inside a node (NCCL over NVLink)
    inter_alpha: float = 5e-6     # seconds per message between nodes (InfiniBand RDMA)
    conv_efficiency: float = 0.5  # share of the FP32 peak cuDNN's 3-D convolutions reach (assumed)
    baseline: float = 1.5e9       # bytes per GPU before the model: CUDA context, cuDNN workspace, NCCL buffers
    sources: str = ""


NODES: dict[str, Node] = {
    # Lassen (LLNL): IBM AC922 nodes, 4 V100 SXM2 16 GB, NVLink 2, InfiniBand EDR (LLNL's
    # system description and Oyama et al., arXiv 2007.12856). V100 SXM2: 15.7 TFLOP/s FP32, 900 GB/s HBM2 (NVIDIA's
    # datasheet). NVLink 2 on the AC922: 3 links (75 GB/s each way) between the GPUs of a
    # socket pair; 50 GB/s assumed between any two. EDR: 100 Gb/s = 12.5 GB/s a port, two
    # ports a node assumed (dual rail), so 6.25 GB/s per GPU when all four send.
    "lassen": Node("lassen", 4, 16e9, 15.7e12, 900e9, 50e9, 6.25e9, intra_alpha=1e-5, inter_alpha=5e-6,
                   sources="V100 SXM2 datasheet; Lassen node per arXiv 2007.12856 and LLNL; links assumed as noted"),
    # An H200 node: 8 H200 SXM 141 GB (HBM3e 4.8 TB/s; FP32 67 TFLOP/s, as the H100 SXM),
    # NVLink 4 through NVSwitch (450 GB/s each way per GPU), 4 x 400 Gb/s InfiniBand per
    # node (200 GB/s: 25 GB/s per GPU when all eight send). H100 nodes: 80 GB, 3.35 TB/s.
    "h200": Node("h200", 8, 141e9, 67e12, 4.8e12, 450e9, 25e9, intra_alpha=8e-6, inter_alpha=5e-6,
                 sources="NVIDIA H200/H100 SXM datasheets; 4 x 400 Gb/s per node (a typical HGX cluster)"),
    "h100": Node("h100", 8, 80e9, 67e12, 3.35e12, 450e9, 25e9, intra_alpha=8e-6, inter_alpha=5e-6,
                 sources="NVIDIA H100 SXM datasheet; 4 x 400 Gb/s per node"),
}


def machine_for(node: Node, data: int, spatial: Sequence[int], io_bandwidth: float = 2e9) -> Machine:
    """The ``Machine`` of one split on ``node``s: halos over NVLink while a spatial group fits
    in a node, else over its GPUs' InfiniBand share; the all-reduce over InfiniBand once
    the job spans nodes. ``io_bandwidth``: bytes/s one GPU reads from storage."""
    s = math.prod(spatial)
    halo_in_node = s <= node.gpus
    job_in_node = data * s <= node.gpus
    return Machine(
        default_conv_flops=node.fp32_flops * node.conv_efficiency,
        mem_bandwidth=node.mem_bandwidth * 0.7,  # element-wise kernels reach ~70% of the memory bandwidth
        p2p_alpha=node.intra_alpha if halo_in_node else node.inter_alpha + node.intra_alpha,
        p2p_beta=node.intra_beta if halo_in_node else node.inter_beta,
        ar_alpha=node.intra_alpha if job_in_node else node.inter_alpha + node.intra_alpha,
        ar_beta=node.intra_beta if job_in_node else node.inter_beta,
        layer_overhead=5e-5, spatial_layer_overhead=2e-4, overlap_overhead=3e-5, io_bandwidth=io_bandwidth,
        baseline_memory=node.baseline, busy_factor=1.0, source=f"node-{node.name}", device="cuda")


def predict_on(node: Node, layers: list[Layer], data: int, spatial: Sequence[int], opts: Options) -> dict[str, Any]:
    """``predict`` for one split on ``node``s, with the node-level figures: GPUs, nodes, whether
    it fits the GPU's memory, and the storage bandwidth a node needs to keep up."""
    row = predict(layers, machine_for(node, data, spatial), data, tuple(spatial), opts)
    gpus = data * math.prod(spatial)
    nodes = max(1, math.ceil(gpus / node.gpus))
    per_node = row["read_bytes"] * min(gpus, node.gpus)  # bytes a node reads per step
    row.update(gpus=gpus, nodes=nodes, data=data, spatial=list(spatial), fits=row["memory_bytes"] <= node.memory,
               node_read_bytes=per_node, node_read_bandwidth=per_node / row["step_s"],
               job_read_bandwidth=per_node * nodes / row["step_s"])
    return row
