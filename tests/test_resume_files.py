"""Checkpoint files: atomic writes, clear errors for truncated or foreign files, the newest-checkpoint search, and
how per-rank compression state carries over to another world size (no processes: fast)."""

import os
import time
from typing import Any

import pytest
import torch

import lightning_hetero.resilience.checkpoint as checkpoint_module
from lightning_hetero import HeteroDDPStrategy, PowerSGDCompression, TopKCompression
from lightning_hetero.resilience.checkpoint import AtomicCheckpointIO, CheckpointError, newest_checkpoint
from lightning_hetero.grad.compression import GradientCompression
from lightning_hetero.resilience.resume import resolve_resume
from lightning_hetero.resilience.state import RankStates


def _ckpt(value: float) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((64,), value)}, "epoch": 0, "global_step": 1}


def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path: Any, monkeypatch: Any) -> None:
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint(_ckpt(1.0), path)
    real_save = torch.save

    def crash(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the job is killed while writing

    monkeypatch.setattr(checkpoint_module.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(_ckpt(2.0), path)
    monkeypatch.setattr(checkpoint_module.torch, "save", real_save)
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the temporary file is gone, the old file whole
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((64,), 1.0))
    io.save_checkpoint(_ckpt(3.0), path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((64,), 3.0))


def test_bad_files_get_clear_errors(tmp_path: Any) -> None:
    strategy = HeteroDDPStrategy()
    good = tmp_path / "good.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), good)
    data = good.read_bytes()
    cases = {
        "truncated.ckpt": (data[: len(data) // 2], "truncated"),
        "empty.ckpt": (b"", "empty"),
        "notes.ckpt": (b"hello, not a checkpoint", "not a torch checkpoint"),
    }
    for name, (content, why) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=why) as err:
            strategy.load_checkpoint(tmp_path / name)
        assert name in str(err.value)
    torch.save({"w": torch.zeros(3)}, tmp_path / "weights.pt")  # a bare state_dict
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        strategy.load_checkpoint(tmp_path / "weights.pt")
    assert torch.equal(strategy.load_checkpoint(good)["state_dict"]["w"], torch.full((64,), 1.0))
    with pytest.raises(FileNotFoundError):  # Lightning's error, unchanged
        strategy.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(CheckpointError, match="directory"):
        strategy.load_checkpoint(tmp_path)


def test_newest_checkpoint_skips_unreadable_and_temporary_files(tmp_path: Any) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint(_ckpt(1.0), tmp_path / "step=1.ckpt")
    io.save_checkpoint(_ckpt(2.0), tmp_path / "step=2.ckpt")
    (tmp_path / ".step=3.ckpt.x1.tmp").write_bytes(b"PK")  # left by a writer killed mid-save
    now = time.time()
    os.utime(tmp_path / "step=1.ckpt", (now - 20, now - 20))
    os.utime(tmp_path / "step=2.ckpt", (now - 10, now - 10))
    assert newest_checkpoint([tmp_path, tmp_path / "missing"]) == str(tmp_path / "step=2.ckpt")
    (tmp_path / "step=9.ckpt").write_bytes(b"PK\x03\x04 cut")  # newest, but truncated by another writer
    with pytest.warns(UserWarning, match="truncated"):
        assert newest_checkpoint([tmp_path]) == str(tmp_path / "step=2.ckpt")
    assert newest_checkpoint([tmp_path / "missing"]) is None


@pytest.mark.parametrize("resume", ["", 3, True])
def test_resume_argument_is_checked(resume: Any) -> None:
    with pytest.raises(ValueError, match="`resume`"):
        HeteroDDPStrategy(resume=resume)


def _compression(config: Any, world: int) -> GradientCompression:
    params = [torch.zeros(6, 4, requires_grad=True), torch.zeros(6, requires_grad=True)]
    return GradientCompression(config, params, world, torch.device("cpu"))


def _saved(config: Any, world: int, memory: str, extra: dict) -> list[dict]:
    """What `world` ranks would have saved: distinct memories, the same P / Q everywhere."""
    out = []
    for r in range(world):
        state = _compression(config, world).state_dict()
        state["buckets"][memory] = {0: torch.full((24,), float(r + 1)), 1: torch.full((6,), 10.0 * (r + 1))}
        state["buckets"].update({k: dict(v) for k, v in extra.items()})
        out.append(state)
    return out


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3)])
@pytest.mark.parametrize("kind", ["topk", "powersgd"])
def test_error_feedback_is_folded_into_the_new_ranks(old: int, new: int, kind: str) -> None:
    config = TopKCompression(ratio=0.5) if kind == "topk" else PowerSGDCompression(rank=1, start_iter=2)
    memory = "residual" if kind == "topk" else "error"
    pq = {} if kind == "topk" else {"p": {0: torch.ones(6)}, "q": {0: torch.full((4,), 2.0)}}
    saved = _saved(config, old, memory, pq)
    states = [_compression(config, new).reshard(saved, rank, new) for rank in range(new)]
    for param in (0, 1):
        before = sum(s["buckets"][memory][param] for s in saved)
        after = sum(s["buckets"][memory][param] for s in states if param in s["buckets"][memory])
        assert torch.allclose(after, before * new / old)  # the sum owed to the mean gradient is kept
    # Survivors keep their own; a departed rank's memory goes to rank 0; a new rank starts with none.
    assert torch.allclose(states[1]["buckets"][memory][0], torch.full((24,), 2.0 * new / old))
    if new > old:
        assert states[2]["buckets"][memory] == {}
    for state in states:
        for part, tensors in pq.items():  # P / Q (the same on every rank) reach every rank, new ones included
            assert torch.equal(state["buckets"][part][0], tensors[0])
        _compression(config, new).load_state_dict(state)


def test_rank_state_without_reshard_starts_fresh_with_a_warning() -> None:
    class Plain:
        def state_dict(self) -> dict:
            return {"x": 1}

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("state of another world size must not be loaded as is")

    callback = RankStates()
    callback.load_state_dict({"ranks": [{"plain": {"x": 1}}, {"plain": {"x": 2}}]})  # 2 ranks saved, 1 here
    with pytest.warns(UserWarning, match="starts fresh"):
        callback.register("plain", Plain())


def test_resume_auto_points_fit_at_the_newest_unless_a_path_is_given(tmp_path: Any) -> None:
    """`resume` is resolved before `fit` selects its checkpoint, through the public `trainer.ckpt_path`."""
    from types import SimpleNamespace

    def _fit_impl(model: Any = None, train_dataloaders: Any = None, val_dataloaders: Any = None,
                  datamodule: Any = None, ckpt_path: Any = None) -> None:
        pass

    with pytest.raises(ValueError, match="dirpath"):
        resolve_resume("auto", _fit_impl, (None,), {}, SimpleNamespace(checkpoint_callbacks=[], ckpt_path=None))
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "a.ckpt")
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path))], ckpt_path=None)
    assert resolve_resume("auto", _fit_impl, (None, None, None, None, None), {}, trainer)
    assert trainer.ckpt_path == str(tmp_path / "a.ckpt")
    mine = SimpleNamespace(checkpoint_callbacks=trainer.checkpoint_callbacks, ckpt_path=None)
    assert not resolve_resume("auto", _fit_impl, (None, None, None, None, "mine.ckpt"), {}, mine)  # positional
    assert not resolve_resume("auto", _fit_impl, (None,), {"ckpt_path": "mine.ckpt"}, mine)  # keyword
    assert mine.ckpt_path is None
    assert not resolve_resume(None, _fit_impl, (None,), {}, mine) and mine.ckpt_path is None
    empty = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path / "x"))], ckpt_path=None)
    assert not resolve_resume("auto", _fit_impl, (None,), {}, empty) and empty.ckpt_path is None  # fresh start


def test_hierarchical_residuals_go_to_the_new_leaders() -> None:
    """Saved on 2 hosts x 2 ranks (leaders 0 and 2 compress), resumed on one host of 2 ranks (leader 0 only)."""
    from types import SimpleNamespace

    config = TopKCompression(ratio=0.5, hierarchical=True)
    params = [torch.zeros(6, 4, requires_grad=True)]

    def lab(leaders: tuple) -> Any:
        return SimpleNamespace(leaders={"host": None}, leader_ranks={"host": leaders}, members={"host": [0]},
                               groups={"host": None})

    saved = []
    for r in range(4):
        state = GradientCompression(config, params, 4, torch.device("cpu"), lab((0, 2))).state_dict()
        assert state["group_size"] == 2
        state["buckets"]["residual"] = {0: torch.full((24,), float(r + 1))} if r in (0, 2) else {}
        saved.append(state)
    new = [GradientCompression(config, params, 2, torch.device("cpu"), lab((0,))).reshard(saved, r, 2)
           for r in range(2)]
    assert torch.allclose(new[0]["buckets"]["residual"][0], torch.full((24,), (1.0 + 3.0) * 1 / 2))
    assert new[1]["buckets"]["residual"] == {}  # not a leader any more: its hook does not compress
