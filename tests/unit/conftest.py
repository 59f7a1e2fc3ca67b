import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; two threads under a loaded machine spin and crawl."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
