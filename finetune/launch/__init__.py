"""Beyond one process: rehearse, Slurm, scaling, bandwidth, doctor."""
