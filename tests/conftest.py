"""What every test shares: one gate for tests that need CUDA devices, and one compute thread in the test process.

``@pytest.mark.gpu`` (one device) or ``@pytest.mark.gpu(2)`` (two or more) marks a test that needs that many CUDA
devices; it is skipped, with the count in the reason, on a machine that has fewer. ``-m gpu`` selects them all.
"""

import pytest
import torch

# Ranks forked from the test process (the fork launcher, raw multiprocessing workers) deadlock in OpenMP once the
# parent has run a parallel region: libgomp's thread pool does not survive fork. One thread in the parent keeps every
# later fork safe, whatever order the tests run in.
torch.set_num_threads(1)


def _cuda_devices() -> int:
    # Lightning's count reads NVML and leaves CUDA uninitialised, so fork-launched tests can still fork afterwards.
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    return num_cuda_devices()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = None
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.args[0]) if marker.args else 1
        if available is None:
            available = _cuda_devices()
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device{'s' if needed > 1 else ''}, "
                                                    f"found {available}"))
