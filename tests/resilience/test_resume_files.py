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


def _sharded_checkpoint(path: Any, global_step: int = 4) -> Any:
    """A sharded checkpoint directory as DCP writes one (a shard, the rest of the checkpoint in ``meta.pt``) with its
    checksum manifest."""
    from lightning_hetero.resilience.checkpoint import write_manifest

    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"shard bytes" * 100)
    torch.save({"epoch": 0, "global_step": global_step, "loops": {}}, path / "meta.pt")
    write_manifest(path)
    return path


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
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.sha256"]  # the temporary files are gone
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
    with pytest.raises(ValueError, match="`resilience.resume`"):
        HeteroDDPStrategy(resilience={"resume": resume})


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


def _saved_pair(directory: Any) -> tuple[Any, Any]:
    """An older and a newer checkpoint (1 MB each) in ``directory``, by mtime."""
    io = AtomicCheckpointIO()
    older, newer = directory / "step=3.ckpt", directory / "step=6.ckpt"
    big = {"state_dict": {"w": torch.randn(256, 1024)}, "epoch": 0, "global_step": 3}
    io.save_checkpoint(big, older)
    io.save_checkpoint({**big, "global_step": 6}, newer)
    now = time.time()
    os.utime(older, (now - 20, now - 20))
    os.utime(newer, (now - 10, now - 10))
    return older, newer


def _flip_bytes(path: Any, offset: int, length: int = 1) -> None:
    """Invert ``length`` bytes at ``offset``: always a change (writing a constant is none where the byte held it)."""
    stat = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(length)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a silent bit rot keeps the mtime


def test_damaged_bytes_are_caught_and_resume_falls_back_to_the_older_checkpoint(tmp_path: Any) -> None:
    import zipfile

    older, newer = _saved_pair(tmp_path)
    assert (tmp_path / "step=6.ckpt.sha256").read_text().endswith("  step=6.ckpt\n")  # `sha256sum -c` reads it
    _flip_bytes(newer, os.path.getsize(newer) // 2, 256)  # inside the tensor data
    assert zipfile.is_zipfile(newer)  # the zip directory is intact: only the checksum tells
    with pytest.warns(UserWarning, match="step=6.ckpt.*damaged"):
        assert newest_checkpoint([tmp_path]) == str(older)
    with pytest.raises(CheckpointError, match="damaged") as err:
        HeteroDDPStrategy().load_checkpoint(newer)
    assert "step=6.ckpt" in str(err.value)
    _flip_bytes(older, 40)  # one byte of a local zip header
    with pytest.warns(UserWarning, match="damaged"):
        assert newest_checkpoint([tmp_path]) is None


def test_a_missing_checksum_file_is_not_trusted(tmp_path: Any) -> None:
    older, newer = _saved_pair(tmp_path)
    os.remove(str(newer) + ".sha256")
    with pytest.warns(UserWarning, match="step=6.ckpt.*no checksum file"):
        assert newest_checkpoint([tmp_path]) == str(older)
    os.remove(str(older) + ".sha256")  # none verified (e.g. written by plain Lightning): the newest, with a warning
    with pytest.warns(UserWarning, match="unverified"):
        assert newest_checkpoint([tmp_path]) == str(newer)
    (tmp_path / "step=6.ckpt.sha256").write_text(f"{'0' * 64}  step=3.ckpt\n")  # another file's checksum
    with pytest.warns(UserWarning, match="unverified"):
        assert torch.equal(HeteroDDPStrategy().load_checkpoint(newer)["state_dict"]["w"],
                           torch.load(newer)["state_dict"]["w"])
    AtomicCheckpointIO().remove_checkpoint(older)
    assert sorted(os.listdir(tmp_path)) == ["step=6.ckpt", "step=6.ckpt.sha256"]


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path: Any) -> None:
    old = time.time() - 2 * checkpoint_module.STALE_AFTER_S
    legacy = tmp_path / ".last.ckpt.k2x_9abc.tmp"  # `mkstemp` naming of a save killed long ago
    legacy.write_bytes(b"PK" * 1000)
    os.utime(legacy, (old, old))
    fresh_legacy = tmp_path / ".last.ckpt.q8r7s6t5.tmp"  # maybe a save in progress: too young to tell
    fresh_legacy.write_bytes(b"PK")
    host = checkpoint_module._HOST
    dead = tmp_path / f".last.ckpt.{host}-999999999-0a1b2c3d.tmp"  # this host, its writer gone
    dead.write_bytes(b"PK")
    live = tmp_path / f".last.ckpt.{host}-{os.getpid()}-0a1b2c3d.tmp"  # a save of this process, in progress
    live.write_bytes(b"PK")
    other = tmp_path / ".notes.tmp"  # not ours
    other.write_bytes(b"x")
    os.utime(other, (old, old))
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [fresh_legacy.name, live.name, other.name, "last.ckpt", "last.ckpt.sha256"])
    os.utime(fresh_legacy, (old, old))
    newest_checkpoint([tmp_path])  # a resume cleans too
    assert fresh_legacy.name not in os.listdir(tmp_path)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_files_are_created_with_the_umask(tmp_path: Any, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "a.ckpt")
        checkpoint_module.write_manifest(tmp_path)
    finally:
        os.umask(previous)
    for name in ("a.ckpt", "a.ckpt.sha256", checkpoint_module.MANIFEST_NAME):
        assert os.stat(tmp_path / name).st_mode & 0o777 == mode, name


def test_a_mistyped_resume_directory_is_an_error(tmp_path: Any, caplog: Any) -> None:
    from lightning_hetero.resilience.checkpoint import find_resume_checkpoint

    from types import SimpleNamespace

    from lightning_hetero.resilience.resume import checkpoint_to_resume

    typo = str(tmp_path / "chekpoints")
    with pytest.raises(ValueError, match="`resilience.resume`='.*chekpoints': no such directory"):
        checkpoint_to_resume(typo, SimpleNamespace(checkpoint_callbacks=[]))  # what the launchers call before `fit`
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="`resilience.resume`.*is a file"):
        find_resume_checkpoint(str(tmp_path / "a.ckpt"), [])
    (tmp_path / "empty").mkdir()
    with caplog.at_level("INFO"):
        assert find_resume_checkpoint(str(tmp_path / "empty"), [tmp_path / "empty"]) is None
    assert "fresh start" in caplog.text
    assert find_resume_checkpoint("auto", [typo]) is None  # `ModelCheckpoint` creates its directory on the first save
    assert find_resume_checkpoint(str(tmp_path), [tmp_path]) == str(tmp_path / "a.ckpt")


def test_directory_manifest_finds_changed_missing_and_added_files(tmp_path: Any) -> None:
    from lightning_hetero.resilience.checkpoint import verify_manifest, write_manifest

    shards = tmp_path / "step=10"
    (shards / "sub").mkdir(parents=True)
    for i in range(3):
        (shards / f"__{i}_0.distcp").write_bytes(os.urandom(10_000))
    (shards / "sub" / ".metadata").write_bytes(b"meta")
    assert verify_manifest(shards).startswith("no checksum file")
    assert write_manifest(shards) == str(shards / "checksums.sha256")
    assert verify_manifest(shards) is None
    assert len((shards / "checksums.sha256").read_text().splitlines()) == 4
    _flip_bytes(shards / "__1_0.distcp", 5000)
    assert "__1_0.distcp" in verify_manifest(shards) and "damaged" in verify_manifest(shards)
    write_manifest(shards)
    os.remove(shards / "sub" / ".metadata")
    assert "missing" in verify_manifest(shards) and ".metadata" in verify_manifest(shards)
    write_manifest(shards)
    (shards / "__3_0.distcp").write_bytes(b"late")
    assert "__3_0.distcp" in verify_manifest(shards)


def test_resume_finds_the_newest_sharded_directory_and_skips_a_damaged_one(tmp_path: Any) -> None:
    """A sharded checkpoint (a ``*.ckpt`` directory with its checksum manifest) is a resume candidate like a file;
    a flipped byte in one of its shards sends the resume to the next older good checkpoint, with a warning."""
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), tmp_path / "epoch=0-step=2.ckpt")
    time.sleep(0.05)
    sharded = _sharded_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    (tmp_path / "no-manifest.ckpt").mkdir()  # no manifest: cannot be verified, never used (and said so)
    with pytest.warns(UserWarning, match="skipping .*no-manifest.ckpt.*no checksum file 'checksums.sha256'"):
        assert newest_checkpoint([tmp_path]) == str(sharded)
    (tmp_path / "no-manifest.ckpt").rmdir()
    data = bytearray((sharded / "__0_0.distcp").read_bytes())
    data[7] ^= 0xFF
    (sharded / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="__0_0.distcp"):
        assert newest_checkpoint([tmp_path]) == str(tmp_path / "epoch=0-step=2.ckpt")


def test_resume_says_why_it_skips_a_sharded_directory_whose_manifest_was_deleted(tmp_path: Any) -> None:
    """``resume="auto"`` with the newest sharded checkpoint's ``checksums.sha256`` deleted goes on from the previous
    checkpoint and says why, naming the directory and the missing manifest (not only "going on from")."""
    from lightning_hetero.resilience.checkpoint import find_resume_checkpoint

    older = tmp_path / "epoch=0-step=2.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), older)
    time.sleep(0.05)
    sharded = _sharded_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert find_resume_checkpoint("auto", [tmp_path]) == str(sharded)
    (sharded / "checksums.sha256").unlink()
    with pytest.warns(UserWarning) as said:
        assert find_resume_checkpoint("auto", [tmp_path]) == str(older)
    lines = [str(w.message) for w in said]
    assert any(str(sharded) in line and "no checksum file 'checksums.sha256'" in line for line in lines), lines
    # Nothing verified left: the unverifiable directory is still not used, a fresh start (and the skip said).
    older.unlink()
    os.unlink(str(older) + ".sha256")
    with pytest.warns(UserWarning, match="skipping .*epoch=0-step=4.ckpt"):
        assert find_resume_checkpoint("auto", [tmp_path]) is None


def _copied_with_times_reversed(source: Any, target: Any, names: list[str]) -> None:
    """``source`` copied as ``cp -r`` / a download does (contents only: every time is the copy's), the first of
    ``names`` the most recently modified, the last the oldest."""
    import shutil

    shutil.copytree(source, target, copy_function=shutil.copy)
    now = time.time()
    for age, name in enumerate(names):
        stamp = now - 100 + 10 * (len(names) - age)
        for root, _, files in os.walk(target):
            for file in files:
                if os.path.join(root, file).startswith(str(target / name)):
                    os.utime(os.path.join(root, file), (stamp, stamp))


STEPS = [3, 6, 9, 12, 15]


def test_resume_goes_on_from_the_most_progress_when_a_copy_scrambled_the_file_times(tmp_path: Any, caplog: Any) -> None:
    """A copied folder of checkpoints at steps 3..15 whose times say step 3 is the newest: the resume goes on from
    step 15 (the progress each file records), says so in one line, and skips a damaged or truncated furthest one,
    naming it, for the next furthest (not the most recently modified)."""
    from lightning_hetero.resilience.checkpoint import find_resume_checkpoint

    io = AtomicCheckpointIO()
    for step in STEPS:
        io.save_checkpoint({**_ckpt(float(step)), "global_step": step, "epoch": step // 10},
                           tmp_path / "saved" / f"step={step}.ckpt")
    copy = tmp_path / "copy"
    _copied_with_times_reversed(tmp_path / "saved", copy, [f"step={s}.ckpt" for s in STEPS])
    assert max(os.listdir(copy), key=lambda n: os.path.getmtime(copy / n)).startswith("step=3.ckpt")
    with caplog.at_level("INFO"):
        assert find_resume_checkpoint("auto", [copy]) == str(copy / "step=15.ckpt")
    said = [r.getMessage() for r in caplog.records if "going on from" in r.getMessage()]
    assert len(said) == 1 and "step=15.ckpt" in said[0] and "global step 15, epoch 1" in said[0], said
    assert "step=3.ckpt" in said[0] and "global step 3" in said[0]  # the most recently modified, and what it holds

    _flip_bytes(copy / "step=15.ckpt", os.path.getsize(copy / "step=15.ckpt") // 2, 64)
    with pytest.warns(UserWarning, match="skipping .*step=15.ckpt.*damaged"):
        assert newest_checkpoint([copy]) == str(copy / "step=12.ckpt")
    data = (copy / "step=12.ckpt").read_bytes()
    (copy / "step=12.ckpt").write_bytes(data[: len(data) // 2])  # its progress cannot be read any more
    with pytest.warns(UserWarning) as warned:
        assert newest_checkpoint([copy]) == str(copy / "step=9.ckpt")
    lines = [str(w.message) for w in warned]
    assert any("step=12.ckpt" in line and "truncated" in line for line in lines), lines
    assert any("step=15.ckpt" in line and "damaged" in line for line in lines), lines


def test_resume_goes_on_from_the_sharded_directory_with_the_most_progress_after_a_copy(tmp_path: Any) -> None:
    """The same for sharded checkpoint directories: the step their ``meta.pt`` records decides, whatever the times
    of the copied files (the manifest's included); a damaged shard in the furthest sends the resume to the next."""
    for step in STEPS:
        (tmp_path / "saved").mkdir(exist_ok=True)
        _sharded_checkpoint(tmp_path / "saved" / f"step={step}.ckpt", global_step=step)
    copy = tmp_path / "copy"
    _copied_with_times_reversed(tmp_path / "saved", copy, [f"step={s}.ckpt" for s in STEPS])
    assert newest_checkpoint([copy]) == str(copy / "step=15.ckpt")
    shard = copy / "step=15.ckpt" / "__0_0.distcp"
    _flip_bytes(shard, 5)
    with pytest.warns(UserWarning, match="skipping .*step=15.ckpt.*__0_0.distcp"):
        assert newest_checkpoint([copy]) == str(copy / "step=12.ckpt")


def test_equal_steps_go_by_epoch_then_file_time(tmp_path: Any) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint({**_ckpt(1.0), "global_step": 10, "epoch": 1}, tmp_path / "end-of-epoch-0.ckpt")
    io.save_checkpoint({**_ckpt(1.0), "global_step": 10, "epoch": 0}, tmp_path / "step=10.ckpt")
    now = time.time()
    os.utime(tmp_path / "end-of-epoch-0.ckpt", (now - 20, now - 20))
    assert newest_checkpoint([tmp_path]) == str(tmp_path / "end-of-epoch-0.ckpt")
    io.save_checkpoint({**_ckpt(1.0), "global_step": 10, "epoch": 1}, tmp_path / "again.ckpt")
    assert newest_checkpoint([tmp_path]) == str(tmp_path / "again.ckpt")  # the same progress: the newer file


_RAN: list[str] = []


def _record_call(value: str) -> str:
    _RAN.append(value)
    return value


class _RunsCodeWhenUnpickled:
    def __reduce__(self) -> tuple:
        return _record_call, ("ran",)


def test_progress_is_read_without_running_code_or_reading_tensors(tmp_path: Any) -> None:
    """The reader imports nothing the file names (a user's hyperparameter object stays inert) and reads only the
    archive's pickle; a foreign or damaged file has no progress."""
    from lightning_hetero.resilience.progress import Progress, recorded_progress

    path = tmp_path / "a.ckpt"
    torch.save({**_ckpt(1.0), "global_step": 7, "epoch": 2, "hyper_parameters": {"x": _RunsCodeWhenUnpickled()}},
               path)
    assert recorded_progress(path) == Progress(global_step=7, epoch=2)
    assert _RAN == []
    torch.load(path, weights_only=False)
    assert _RAN == ["ran"]  # what a full load would have done
    torch.save({"w": torch.zeros(3)}, tmp_path / "weights.pt")
    (tmp_path / "notes.ckpt").write_bytes(b"hello")
    for foreign in (tmp_path / "weights.pt", tmp_path / "notes.ckpt", tmp_path / "missing.ckpt", tmp_path):
        assert recorded_progress(foreign) is None
