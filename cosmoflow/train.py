"""Train CosmoFlow (MLPerf HPC) with spatial x data parallelism.

Configs live in ``configs/cosmoflow/`` (``default`` = MLPerf 128^3, ``mlperf512`` whole
512^3 boxes, ``quickstart`` the tiny CPU run); every field can be overridden. Generate
data first (``python -m cosmoflow.prepare synthetic --out data/cosmo32 --size 32 ...``).

Single process (CPU or one GPU)::

    python -m cosmoflow.train --config-name quickstart data.dir=data/cosmo32 run.dir=runs/cf

torchrun, 2 ranks splitting each sample in depth::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m cosmoflow.train \\
        --config-name quickstart parallel.spatial=[2,1,1] run.dir=runs/cf2

mpirun / mpiexec (8 ranks: data 2 x spatial 2x2x1)::

    mpirun -n 8 python -m cosmoflow.train parallel.spatial=[2,2,1] data.dir=/data/cosmoUniverse

srun (4 nodes x 4 GPUs, 512^3 boxes split 4x2x2)::

    srun -N 4 --ntasks-per-node 4 python -m cosmoflow.train --config-name mlperf512 \\
        parallel.spatial=[4,2,2] data.dir=/data/cosmo512

Resume: add ``train.resume=true`` (continues from ``run.dir/checkpoints/last.pt``).
"""

from cosmoflow.family import FAMILY
from parallel.train.cli import main

if __name__ == "__main__":
    main(FAMILY)
