"""A run: Accelerator, preflight, optimiser, the loop, dry run and simulation."""
