"""`finetune doctor`: check the machine (and, under a launcher, every rank) before a multi-GPU run.

    finetune doctor [--output-dir DIR] [--json]
    torchrun --nnodes 2 --nproc_per_node 8 ... -m finetune doctor      # every rank reports, rank 0 compares

It checks what multi-GPU tutorials tell people to check by hand: GPUs visible and identical, bf16,
driver / CUDA / torch / NCCL versions, interconnect and peer access, NCCL environment variables,
/dev/shm, host RAM, free disk, the default accelerate config and what it would launch, package
versions, and with ≥ 2 GPUs (or ranks) the all-reduce bus bandwidth against what the link should
give. Exit code 1 when a finding fails, else 0.

    probe.py    what one process sees of its machine (the only part that reads the system)
    checks.py   facts → findings, each with its fix; pure, so every check is tested on synthetic machines
    command.py  the CLI: probe, exchange facts between ranks, measure the all-reduce, check, print
"""
