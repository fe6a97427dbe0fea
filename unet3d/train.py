"""Train the MLPerf 3D U-Net with spatial x data parallelism.

Configs live in ``configs/unet3d/`` (``default`` = MLPerf KiTS19 settings,
``quickstart`` the tiny CPU run); every field can be overridden. Generate data first
(``python -m unet3d.prepare synthetic --out data/unet32 --size 32 ...``).

Single process (CPU or one GPU)::

    python -m unet3d.train --config-name quickstart data.dir=data/unet32 run.dir=runs/unet

torchrun, 2 ranks splitting each volume in depth::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 -m unet3d.train \\
        --config-name quickstart parallel.spatial=[2,1,1] run.dir=runs/unet2

mpirun / mpiexec (8 ranks: data 2 x spatial 2x2x1)::

    mpirun -n 8 python -m unet3d.train parallel.spatial=[2,2,1] data.dir=/data/kits19_h5

srun (whole CT volumes split 4 ways per sample, 2 data groups)::

    srun -N 2 --ntasks-per-node 4 python -m unet3d.train parallel.spatial=[4,1,1] data.dir=/data/kits19_h5

Resume: add ``train.resume=true`` (continues from ``run.dir/checkpoints/last.pt``).
"""

from parallel.train.cli import main
from unet3d.family import FAMILY

if __name__ == "__main__":
    main(FAMILY)
