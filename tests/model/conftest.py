"""The model tests run torch single-threaded.

On the shared 2-core machine a 2-thread torch process spins in OpenMP barriers whenever
another process holds a core, which made these tests ~10x slower (139 s vs 11 s measured).
The previous setting is restored after each test.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_torch():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
