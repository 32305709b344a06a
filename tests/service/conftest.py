"""Shared fixtures of the service tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module's servers: the machine is shared, the tiny model needs no more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
