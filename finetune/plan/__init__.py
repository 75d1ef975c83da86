"""The planner: workload → memory, speed, cost, the recommended plan and its files. Torch-free."""
