"""Version adapters of ``lightning_hetero._compat``: what they pass on depends on the Lightning that is installed."""

import lightning
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_hetero._compat import weights_only_argument


def test_weights_only_is_forwarded_only_to_a_load_that_takes_it() -> None:
    def load_2_6(path: str, map_location: object = None, weights_only: object = None) -> None: ...
    def load_2_5(path: str, map_location: object = None) -> None: ...

    assert weights_only_argument(load_2_6, True) == {"weights_only": True}
    assert weights_only_argument(load_2_6, None) == {"weights_only": None}
    assert weights_only_argument(load_2_5, True) == {}
    # Lightning's own CheckpointIO, bound as `super().load_checkpoint` is: 2.6 takes the argument, 2.5 does not.
    takes_it = tuple(int(part) for part in lightning.__version__.split(".")[:2]) >= (2, 6)
    expected = {"weights_only": False} if takes_it else {}
    assert weights_only_argument(TorchCheckpointIO().load_checkpoint, False) == expected
