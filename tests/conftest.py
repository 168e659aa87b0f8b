import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "unit"))


@pytest.fixture
def cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the H200 via the device tool)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (runs on the H200 via the device tool)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
