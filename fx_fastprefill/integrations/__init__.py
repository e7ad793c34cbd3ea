"""Ways into the backend from other stacks' entry points (transformers ``generate``)."""
