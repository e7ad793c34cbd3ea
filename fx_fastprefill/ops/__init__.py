"""The package's custom ops: schemas and handles (``schema``), kernels (``attention``, ``sdpa``, ``kernels/``)."""
