"""Launch paths a user takes: the registry name with the popen launcher, LightningCLI YAML, two nodes on loopback."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from tests.helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "strategies", "_launch_worker.py")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), **extra)
    return env


def _records(out_dir, world):
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.slow
def test_registry_name_with_popen_launcher(tmp_path):
    subprocess.run([sys.executable, WORKER, str(tmp_path), "registry"], env=_env(), check=True, timeout=300,
                   cwd=ROOT)
    records = _records(tmp_path, 2)
    assert records[0]["steps"] == records[1]["steps"] == 10  # 40 samples in global batches of 8, 2 epochs
    assert torch.equal(records[0]["params"][-1], records[1]["params"][-1])


@pytest.mark.slow
def test_two_nodes_rendezvous_on_loopback(tmp_path):
    env = _env(WORLD_SIZE="2", LOCAL_RANK="0")
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(tmp_path), "node"], env={**env, "NODE_RANK": str(n)}, cwd=ROOT)
        for n in range(2)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0]
    records = _records(tmp_path, 2)
    assert [len(b) for b in records[0]["indices"]][:2] == [6, 6]
    assert [len(b) for b in records[1]["indices"]][:2] == [2, 2]
    for a, b in zip(records[0]["params"], records[1]["params"]):
        assert torch.equal(a, b)
    lab = torch.load(os.path.join(tmp_path, "lab0.pt"))
    assert lab["split"] == [6, 2] and lab["capacity_source"] == "explicit"


@pytest.mark.slow
def test_yaml_class_path_config_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "fit", "--config",
         os.path.join(ROOT, "configs", "cpu_smoke.yaml"), f"--trainer.default_root_dir={tmp_path}"],
        env=_env(), capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HeteroDDPStrategy lab:" in result.stdout + result.stderr
    assert "final metrics:" in result.stdout


@pytest.mark.parametrize("config", ["cpu_smoke.yaml", "cpu_lab.yaml", "lab_a100_3090.yaml", "gpu_auto.yaml",
                                    "all_options.yaml"])
def test_every_config_parses(config):
    """Each shipped YAML file is a valid LightningCLI config for the example (checked without training)."""
    from jsonargparse import ArgumentParser  # noqa: F401  (LightningCLI needs it)

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_digits import DigitsClassifier, DigitsDataModule
    from lightning.pytorch.cli import LightningCLI

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the shipped configs use the grouped spelling
        cli = LightningCLI(DigitsClassifier, DigitsDataModule, run=False,
                           args=["--config", os.path.join(ROOT, "configs", config), "--trainer.accelerator=cpu",
                                 "--trainer.devices=1"])
    from lightning_hetero import HeteroDDPStrategy

    assert isinstance(cli.trainer.strategy, HeteroDDPStrategy)
    if config == "cpu_lab.yaml":
        assert cli.trainer.strategy.core.options.profiling.steps == 200
        assert cli.trainer.strategy.core.options.resilience.timeout == 300


def test_flat_and_grouped_yaml_spellings_give_the_same_options(tmp_path):
    """Earlier releases' flat arguments still parse from YAML, with a FutureWarning naming the grouped spelling."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_digits import DigitsClassifier, DigitsDataModule
    from lightning.pytorch.cli import LightningCLI

    def options(init_args: str) -> object:
        path = tmp_path / "c.yaml"
        path.write_text("trainer:\n  strategy:\n    class_path: lightning_hetero.HeteroDDPStrategy\n"
                        f"    init_args: {init_args}\n")
        cli = LightningCLI(DigitsClassifier, DigitsDataModule, run=False,
                           args=["--config", str(path), "--trainer.accelerator=cpu", "--trainer.devices=1"])
        return cli.trainer.strategy.core.options

    # Every flat name warns once; all of them are recorded here (pytest.warns would re-emit the ones it does not match,
    # which the pytest configuration turns into errors).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = options("{profile_steps: 8, rebalance: true, rebalance_every: 5, resume: auto, balance: tokens}")
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    for grouped_spelling in ("profiling={'steps': 8}", "rebalance={'every': 5}", "resilience={'resume': 'auto'}",
                             "data={'balance': 'tokens'}"):
        assert any(grouped_spelling in m for m in messages), (grouped_spelling, messages)
    grouped = options("{profiling: {steps: 8}, rebalance: {every: 5}, resilience: {resume: auto}, "
                      "data: {balance: tokens}}")
    assert flat == grouped and grouped.rebalance.every == 5 and grouped.data.balance == "tokens"
    with pytest.raises((SystemExit, ValueError), match=None) as bad:  # jsonargparse refuses the value
        options("{profiling: {steps: 0}}")
    assert bad.type is SystemExit or "steps=0" in str(bad.value)
