import os
import tempfile

import pytest
import torch

# Each test session compiles into caches of its own (Inductor's, AOTAutograd's, the package's
# programs in it): a run never serves a program compiled by an earlier run of different code.
# Set before the first compile, and inherited by the subprocesses tests start.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ffp-test-inductor-")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
