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


def test_pipeline_transfers_time_each_wait_of_a_schedule(monkeypatch) -> None:
    """Inside ``pipeline_transfers`` the schedules' ``_batch_p2p`` posts through ``posting`` and every work it
    returns waits through ``waiting``, tagged by whether its operation is a receive; a release whose ``_batch_p2p``
    returns one work (or None) gets one timed work; outside, the schedules' own function is back."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from lightning_hetero._compat import pipeline_transfers

    class Work:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self) -> str:
            return self.name

    class Op:  # what `_batch_p2p` reads of a P2POp
        def __init__(self, op: object) -> None:
            self.op = op

    ops = [Op(dist.isend), Op(dist.irecv)]
    original = schedules._batch_p2p
    seen: list = []

    def posting(post):
        seen.append("post")
        return post()

    def waiting(receives, wait):
        seen.append(receives)
        return wait()

    monkeypatch.setattr(schedules, "_batch_p2p", lambda p2p_ops, desc=None: [Work("send"), Work("recv")])
    with pipeline_transfers(posting, waiting):
        works = schedules._batch_p2p(ops, desc="fwd_send_bwd_recv")
        assert [w.wait() for w in works] == ["send", "recv"]
    assert seen == ["post", False, True]
    def one_work(p2p_ops, desc=None):
        return Work("coalesced")

    monkeypatch.setattr(schedules, "_batch_p2p", one_work)
    with pipeline_transfers(posting, waiting):
        assert schedules._batch_p2p(ops).wait() == "coalesced"
    assert seen[-2:] == ["post", True]
    assert schedules._batch_p2p is one_work
    monkeypatch.undo()
    assert schedules._batch_p2p is original
