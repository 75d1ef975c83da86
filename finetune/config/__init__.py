"""What the user asks for, resolved once: options, names, DeepSpeed JSON, ResolvedRun. Torch-free."""
