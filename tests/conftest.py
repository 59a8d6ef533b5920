"""What every test folder shares: one GPU-count gate.

A test that needs CUDA devices says how many with ``@pytest.mark.gpus(n)`` (beside ``@pytest.mark.gpu``, which
``-m gpu`` selects); with fewer devices it is skipped here, in one place, the counts in the reason.

Example::
    pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]
"""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): needs n CUDA devices (skipped with fewer)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = {item: item.get_closest_marker("gpus") for item in items}
    if not any(needs.values()):
        return
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    # Counted without initialising CUDA in this process: tests fork their ranks after collection.
    available = num_cuda_devices()
    for item, marker in needs.items():
        if marker is None:
            continue
        wanted = int(marker.args[0]) if marker.args else 1
        if available < wanted:
            devices = "device" if wanted == 1 else "devices"
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} CUDA {devices}, {available} here"))
