"""Labs across hosts: emulated hosts, the paced inter-host link, two-level sync and compression="auto"."""

import copy
import os
import time
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hetero import HeteroDDPStrategy
from lightning_hetero.grad.autocompress import AutoCompression, LinkMeasurement, choose
from lightning_hetero.grad.compression_config import (
    CastCompression,
    NoCompression,
    PowerSGDCompression,
    TopKCompression,
    parse_compression,
)
from lightning_hetero.lab.devices import HOST_OVERRIDE_ENV, describe_device
from lightning_hetero.lab.emulation import start_emulation
from lightning_hetero.lab.emulation_env import job_link_class
from lightning_hetero.lab.emulation_spec import parse_emulate
from lightning_hetero.lab.link_pacing import LinkPacer
from tests.helpers import Recorder, TinyModel, free_port, max_rel_diff, reference_run

HOSTS_2X2 = [{"host": "a"}, {"host": "a"}, {"host": "b"}, {"host": "b"}]


# -- emulated host ----------------------------------------------------------------------------------------------------
def test_emulated_host_sets_host_name_and_nccl_host_id(monkeypatch):
    for key in (HOST_OVERRIDE_ENV, "NCCL_HOSTID", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(key, raising=False)
    specs = parse_emulate(HOSTS_2X2)
    cpu = torch.device("cpu")
    ids = {}
    for rank in range(4):
        emulator = start_emulation(specs, rank, 4, describe_device(cpu, rank), cpu)
        assert describe_device(cpu, rank).host == HOSTS_2X2[rank]["host"]
        ids[rank] = os.environ["NCCL_HOSTID"]
        assert os.environ["NCCL_IB_DISABLE"] == "1"
        assert f"host {HOSTS_2X2[rank]['host']}" in emulator.summary()
        emulator.restore()
        assert HOST_OVERRIDE_ENV not in os.environ and "NCCL_HOSTID" not in os.environ
    assert ids[0] == ids[1] != ids[2] == ids[3]  # NCCL sees two machines


def test_a_rank_without_profile_stays_on_its_real_host(monkeypatch):
    monkeypatch.delenv(HOST_OVERRIDE_ENV, raising=False)
    specs = parse_emulate([{"host": "ws"}, None])
    cpu = torch.device("cpu")
    emulator = start_emulation(specs, 1, 2, describe_device(cpu, 1), cpu)
    try:
        assert os.environ[HOST_OVERRIDE_ENV] == describe_device(cpu, 1).host != "ws"
    finally:
        emulator.restore()


@pytest.mark.parametrize(("entry", "field"), [({"host": ""}, "emulate[0].host"), ({"host": "a b"}, "emulate[0].host"),
                                              ({"host": 3}, "emulate[0].host"),
                                              ({"inter_host_gbit": 0}, "emulate[0].inter_host_gbit")])
def test_bad_host_profile_names_the_field(entry, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_emulate([entry])


def test_ethernet_is_the_hop_between_emulated_hosts():
    assert job_link_class(parse_emulate([{"link": "ethernet"}, None])) == "ethernet"  # one host: all of NCCL slowed
    assert job_link_class(parse_emulate([{"host": "a", "link": "ethernet"}, {"host": "b"}])) == "nvlink"
    assert job_link_class(parse_emulate([{"host": "a", "link": "pcie"}, {"host": "b", "link": "ethernet"}])) == "pcie"


# -- paced link -------------------------------------------------------------------------------------------------------
def test_link_pacer_holds_for_the_bytes_and_overlaps_with_compute():
    pacer = LinkPacer(gbit=0.08, participants=2, device=torch.device("cpu"))  # 10 MB/s, ring factor 1

    def settled_after(*sizes: int) -> tuple[float, float]:
        """Seconds slept for transfers sent now, and seconds from sending to the end of the pause. A loaded host can
        hold the process between sending and settling, and the pause owed is then shorter: so no fixed band."""
        sent = time.perf_counter()
        for nbytes in sizes:
            pacer.transfer(nbytes)
        settling = time.perf_counter()
        slept = pacer.settle()
        ended = time.perf_counter()
        assert ended - settling >= slept  # really slept
        return slept, ended - sent

    slept, held = settled_after(1_000_000)
    assert slept <= 0.1 + 1e-6 and held >= 0.1 - 1e-6  # held until the bytes crossed, not longer than owed
    pacer.transfer(1_000_000)  # sent while 0.15 s of "backward" still runs: fully hidden
    time.sleep(0.15)
    assert pacer.settle() == 0.0
    slept, held = settled_after(500_000, 500_000)  # two back-to-back transfers share the link
    assert slept <= 0.1 + 1e-6 and held >= 0.1 - 1e-6
    assert LinkPacer(gbit=10, participants=4, device=torch.device("cpu")).factor == 1.5


# -- compression="auto" -------------------------------------------------------------------------------------------------
def _links(hosts: int, ranks_per_host: int, intra_gbps: float, inter_gbps: float) -> LinkMeasurement:
    probe = 16 << 20
    intra = probe * 2 * (ranks_per_host - 1) / ranks_per_host / (intra_gbps * 1e9) if ranks_per_host > 1 else None
    inter = probe * 2 * (hosts - 1) / hosts / (inter_gbps * 1e9) if hosts > 1 else None
    return LinkMeasurement(probe, intra, inter, hosts, ranks_per_host)


@pytest.mark.parametrize(("links", "grad_mb", "expected"), [
    (_links(1, 2, 250, 0), 500, None),  # one host on NVLink: plain all-reduce
    (_links(1, 2, 20, 0), 1, None),  # PCIe, small gradient: nothing exposed
    (_links(1, 2, 20, 0), 500, CastCompression(dtype="bf16")),  # PCIe, 500 MB: 25 ms exposed
    (_links(2, 2, 250, 100), 500, NoCompression(hierarchical=True)),  # fast network: two-level fp32
    (_links(2, 1, 0, 3.1), 500, CastCompression(dtype="bf16", hierarchical=True)),  # 25 GbE, GPT-small: lossless
    (_links(2, 1, 0, 1.25), 0.1, NoCompression(hierarchical=True)),  # 10 GbE but a tiny model
    (_links(2, 1, 0, 3.1), 90, CastCompression(dtype="bf16", hierarchical=True)),  # 29 ms fp32, 15 ms bf16
], ids=["nvlink", "pcie-small", "pcie-large", "fast-network", "25gbe-large", "10gbe-tiny", "25gbe-mid"])
def test_auto_choice_follows_the_slow_hop(links, grad_mb, expected):
    chosen, reason = choose(AutoCompression(), links, int(grad_mb * 1e6))
    assert chosen == expected, reason
    if links.hosts > 1:
        assert chosen.hierarchical and "between hosts" in reason


def test_auto_choice_with_a_known_step_time_and_topk():
    links = _links(2, 1, 0, 1.25)  # 10 GbE: 500 MB of fp32 gradient take 400 ms
    assert choose(AutoCompression(step_seconds=4.0), links, 500_000_000)[0] == NoCompression(hierarchical=True)
    assert choose(AutoCompression(step_seconds=1.0), links, 500_000_000)[0] == CastCompression(
        dtype="bf16", hierarchical=True)
    assert isinstance(choose(AutoCompression(step_seconds=0.3, strong="topk"), links, 500_000_000)[0],
                      TopKCompression)
    # The lossy methods are opt-in: by default an exposed Ethernet exchange gets bf16, with strong="powersgd" PowerSGD.
    assert choose(AutoCompression(step_seconds=0.3), links, 500_000_000)[0] == CastCompression(
        dtype="bf16", hierarchical=True)
    assert choose(AutoCompression(step_seconds=0.3, strong="powersgd"), links, 500_000_000)[0] == PowerSGDCompression(
        rank=4, hierarchical=True)


def test_auto_is_parsed_and_validated():
    assert parse_compression("auto") == AutoCompression()
    with pytest.raises(ValueError, match="AutoCompression.strong"):
        AutoCompression(strong="qsgd")
    with pytest.raises(ValueError, match="AutoCompression.step_seconds"):
        AutoCompression(step_seconds=0)
    with pytest.raises(ValueError, match="NoCompression.group_by"):
        NoCompression(group_by="rack")


# -- two-level sync in training (4 gloo ranks on 2 emulated hosts) -------------------------------------------------------
class HostRecorder(Recorder):
    """The helpers' recorder plus the lab's hosts and the bytes each hop carried in the last step."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        strategy = trainer.strategy
        self.hops = dict(strategy.compression.bytes_by_hop_last_step)
        self.hosts = {k: list(v) for k, v in strategy.lab.hosts.items()}
        pacer = getattr(strategy.weighting.inner_state, "pacer", None)
        self.paced_bytes = pacer.wire_bytes if pacer is not None else 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save({"params": self.params, "indices": self.indices, "steps": trainer.global_step, "hops": self.hops,
                    "hosts": self.hosts, "paced_bytes": self.paced_bytes},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def fit_hosts(model: LightningModule, out_dir: str, compression: Any, capacities: list[float], epochs: int,
              ckpt_path: Any = None, save_every_epoch: bool = False, emulate: Any = None) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    os.environ["MASTER_PORT"] = str(free_port())
    strategy = HeteroDDPStrategy(capacities=capacities, emulate=emulate or HOSTS_2X2, compression=compression,
                                 start_method="fork", observation={"print_table": False}, resilience={"timeout": 120})
    callbacks: list[Any] = [HostRecorder(out_dir)]
    if save_every_epoch:
        callbacks.append(ModelCheckpoint(dirpath=out_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}"))
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=epochs, callbacks=callbacks,
                      logger=False, enable_checkpointing=save_every_epoch, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(4)]


CAPACITIES = [3.0, 1.0, 2.0, 1.0]
N = 50  # global batch 16: the last global batch has 2 samples for 4 ranks, so two ranks run padding steps


@pytest.mark.slow
@pytest.mark.parametrize("compression", [NoCompression(hierarchical=True), "none"], ids=["two-level", "flat-paced"])
def test_two_level_sync_equals_one_process(tmp_path, compression):
    """Sum inside each host, fp32 exchange between the leaders, broadcast back: the same parameters as one process on
    the global batch (b_r / G weights, partial last batches, zero-weight padding steps), replicas bit-identical.
    The flat all-reduce through the paced link's hook is exact too."""
    seed_everything(0)
    model = TinyModel("sgd", n=N)
    reference_model, floor_model = copy.deepcopy(model), copy.deepcopy(model)
    epochs = 5
    emulate = [{**h, "inter_host_gbit": 100} for h in HOSTS_2X2]
    records = fit_hosts(model, str(tmp_path), compression, CAPACITIES, epochs, emulate=emulate)
    ref_params, _ = reference_run(reference_model, 4, CAPACITIES, epochs)
    floor_params, _ = reference_run(floor_model, 4, CAPACITIES, epochs, shuffle_within=True)
    assert records[0]["hosts"] == {"a": [0, 1], "b": [2, 3]}
    if compression == "none":
        assert records[0]["paced_bytes"] > 0  # every step's gradient crossed the paced link
    else:  # leaders: 0, 2
        assert set(records[0]["hops"]) == {"intra", "inter"} and set(records[1]["hops"]) == {"intra"}
    assert {r["steps"] for r in records} == {len(ref_params)} == {20}
    for step in range(len(ref_params)):
        for r in range(1, 4):
            assert torch.equal(records[r]["params"][step], records[0]["params"][step]), (r, step)
    diff = max(max_rel_diff(records[0]["params"][s], ref_params[s]) for s in range(len(ref_params)))
    floor = max(max_rel_diff(floor_params[s], ref_params[s]) for s in range(len(ref_params)))
    assert diff <= max(1e-6, 2 * floor), (diff, floor)


@pytest.mark.slow
@pytest.mark.parametrize("compression", [CastCompression(dtype="bf16", hierarchical=True),
                                         PowerSGDCompression(rank=2, start_iter=2, hierarchical=True)],
                         ids=["bf16", "powersgd"])
def test_hierarchical_methods_keep_replicas_identical(tmp_path, compression):
    seed_everything(0)
    model = TinyModel("sgd", n=N)
    reference_model = copy.deepcopy(model)
    records = fit_hosts(model, str(tmp_path), compression, CAPACITIES, 3)
    ref_params, _ = reference_run(reference_model, 4, CAPACITIES, 3)
    for step in range(len(ref_params)):
        for r in range(1, 4):
            assert torch.equal(records[r]["params"][step], records[0]["params"][step]), (r, step)
    assert set(records[2]["hops"]) == {"intra", "inter"}
    # Lossy only between the hosts, and only a little: far from a run that went wrong.
    assert max_rel_diff(records[0]["params"][-1], ref_params[-1]) < 0.05


@pytest.mark.slow
def test_hierarchical_topk_state_per_rank_resumes_exactly(tmp_path):
    """Top-k residuals live on the two leaders only (the other ranks never compress): a checkpoint saves each rank's
    own state and a resume repeats the uninterrupted run bit for bit on every rank."""
    compression = TopKCompression(ratio=0.3, hierarchical=True)
    seed_everything(0)
    model = TinyModel("sgd", n=N)
    resumed_model = copy.deepcopy(model)
    full = fit_hosts(model, str(tmp_path / "full"), compression, CAPACITIES, 4, save_every_epoch=True)
    for step in range(len(full[0]["params"])):
        for r in range(1, 4):
            assert torch.equal(full[r]["params"][step], full[0]["params"][step]), (r, step)
    ckpt = torch.load(tmp_path / "full" / "epoch=1.ckpt", weights_only=False)
    ranks = ckpt["lightning_hetero"]["ranks"]
    residuals = [r["compression"]["buckets"]["residual"] for r in ranks]
    assert residuals[0] and residuals[2] and not residuals[1] and not residuals[3]
    assert not all(torch.equal(a, b) for a, b in zip(residuals[0].values(), residuals[2].values()))
    resumed = fit_hosts(resumed_model, str(tmp_path / "resumed"), compression, CAPACITIES, 4,
                        ckpt_path=str(tmp_path / "full" / "epoch=1.ckpt"))
    start = 2 * 4  # 4 steps an epoch
    for rank in range(4):
        assert len(resumed[rank]["params"]) == len(full[rank]["params"]) - start
        for step, params in enumerate(resumed[rank]["params"]):
            assert torch.equal(params, full[rank]["params"][start + step]), (rank, start + step)


# -- doctor: P2P per pair and the NCCL settings to export ----------------------------------------------------------------
def test_doctor_recommends_nccl_settings_for_cards_without_p2p():
    from lightning_hetero.observe.doctor import nccl_recommendations

    a100s = ["NVIDIA A100-SXM4-80GB"] * 2
    assert nccl_recommendations([{"pair": [0, 1], "p2p": True}], a100s, []) == {}
    rec = nccl_recommendations([{"pair": [0, 1], "p2p": False}], ["NVIDIA GeForce RTX 3090"] * 2, [])
    assert rec["NCCL_P2P_DISABLE"][0] == "1" and "[[0, 1]]" in rec["NCCL_P2P_DISABLE"][1]
    rec = nccl_recommendations([{"pair": [0, 1], "p2p": True}], ["NVIDIA GeForce RTX 4090"] * 2, [])
    assert rec["NCCL_P2P_DISABLE"][0] == "1"  # reported, but unreliable on consumer cards
    nics = [{"name": "eno1", "gbit": 1.0}, {"name": "enp65s0", "gbit": 25.0}, {"name": "wlan0", "gbit": None}]
    assert nccl_recommendations([], a100s[:1], nics)["NCCL_SOCKET_IFNAME"][0] == "enp65s0"


def test_doctor_report_lists_pairs_and_network():
    import json

    from lightning_hetero.observe.doctor import diagnose, format_report

    report = diagnose()
    json.dumps(report)
    assert isinstance(report["network"], list) and isinstance(report["nccl_recommended"], dict)
    assert len(report["peer_access"]) == torch.cuda.device_count() * (torch.cuda.device_count() - 1) // 2
    format_report(report)


# -- the benchmark, tiny, on CPU ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_hosts_tiny_cpu_run(tmp_path):
    import json
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    import bench_hosts

    rows = bench_hosts.main(["--tiny", "--accelerator", "cpu", "--layout", "1+1", "--models", "gpt", "--links", "10gbe",
                             "--configs", "solo,ddp,auto,periodic", "--every", "2", "--warmup", "1", "--steps", "3",
                             "--out", str(tmp_path)])
    by = {r["config"]: r for r in rows}
    assert set(by) == {"solo", "ddp", "auto", "periodic"} and not any("error" in r for r in rows), rows
    # The workstation's rank ran under its emulation in every configuration; held-out losses after the same samples.
    assert all(r["capped"] == [None, True] for r in rows), [(r["config"], r["capped"]) for r in rows]
    assert by["periodic"]["held_out_vs_ddp"] is not None and by["ddp"]["held_out_vs_ddp"] == 0.0
    assert by["auto"]["hosts"] == {"server": [0], "ws": [1]}
    assert by["auto"]["compression"][0].startswith("auto: ") and "across" in by["auto"]["compression"][0]
    for config in ("ddp", "auto"):
        assert by[config]["samples_per_s"] > 0 and len(by[config]["losses"]) == 4
        assert all(loss == loss and loss > 0 for loss in by[config]["losses"])
        assert by[config]["fraction_of_ideal"] is not None and by[config]["ratio_to_ddp"] is not None
    saved = json.loads((tmp_path / "bench_hosts.json").read_text())
    assert saved["layout"] == "1+1" and len(saved["rows"]) == 4
