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



def test_host_staged_transfers_send_and_receive_device_tensors_through_host_copies(monkeypatch) -> None:
    """Inside ``host_staged_transfers`` a schedule's send of a device tensor posts a host copy of it, a receive posts
    a host buffer whose data lands in the device tensor when its work is waited on (or, where the works are
    coalesced, once they are all done); host tensors pass as they are; outside, the schedules' own function is
    back. (``meta`` tensors stand in for CUDA ones: the staging is by device type.)"""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from lightning_hetero._compat import host_staged_transfers

    class Op:  # what the staging reads of a P2POp, and builds one with
        def __init__(self, op: object, tensor: torch.Tensor, peer: int = 1, group: object = None, tag: int = 0):
            self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag

    class Work:
        def __init__(self, ops: list) -> None:
            self.ops, self.waited = ops, 0

        def wait(self) -> bool:
            for op in self.ops:
                if op.op is dist.irecv:
                    op.tensor.fill_(7.0)  # the peer's data arrives
            self.waited += 1
            return True

    posted: list = []

    def one_each(p2p_ops, desc=None):
        posted.append(p2p_ops)
        return [Work([op]) for op in p2p_ops]

    def coalesced(p2p_ops, desc=None):
        return Work(p2p_ops)

    landed: list = []
    monkeypatch.setattr(dist, "P2POp", Op)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src: landed.append((self.device.type, src.tolist())))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: torch.full(self.shape, 5.0))
    sent, received, host = torch.ones(2, device="meta"), torch.empty(3, device="meta"), torch.zeros(1)
    monkeypatch.setattr(schedules, "_batch_p2p", one_each)
    with host_staged_transfers():
        works = schedules._batch_p2p([Op(dist.isend, sent), Op(dist.irecv, received), Op(dist.isend, host)],
                                     desc="fwd_send_bwd_recv")
        ops = posted[-1]
        assert [op.tensor.device.type for op in ops] == ["cpu", "cpu", "cpu"] and ops[2].tensor is host
        assert ops[0].tensor.tolist() == [5.0, 5.0] and ops[1].tensor.shape == (3,)
        assert landed == []  # nothing lands before its work is waited on
        assert [w.wait() for w in works] == [True, True, True]
        assert landed == [("meta", [7.0, 7.0, 7.0])]
        works[1].wait()
        assert len(landed) == 1  # once
    assert schedules._batch_p2p is one_each
    monkeypatch.setattr(schedules, "_batch_p2p", coalesced)
    with host_staged_transfers():
        work = schedules._batch_p2p([Op(dist.isend, sent), Op(dist.irecv, received)])
        assert work.waited == 1 and landed[-1] == ("meta", [7.0, 7.0, 7.0])
    assert schedules._batch_p2p is coalesced
