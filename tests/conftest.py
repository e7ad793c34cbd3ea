import os
import tempfile

import pytest
import torch
import torch._functorch.config  # read by a fixture below; nothing else may have imported it yet

# Each test session compiles into caches of its own (Inductor's, AOTAutograd's), inherited by the
# subprocesses tests start: a run never serves a program compiled by an earlier run.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ffp-test-inductor-")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _program_cache_only_where_tested(request):
    """The AOTAutograd cache (and with it the package's program cache) is off in-process except in
    tests marked ``program_cache``: most tests read what a compile makes (its graph, its logs),
    which a program loaded from an earlier test's compile would not have, depending on test order."""
    if request.node.get_closest_marker("program_cache"):
        yield
        return
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield
