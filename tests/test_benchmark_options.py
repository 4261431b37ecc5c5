"""The benchmark scripts' command lines agree with each other and with ``torchvote``: ``--batch-size``
in every script (each script's earlier spelling kept), the CLI's device names, defaults in
``--help``, what ``--dtype`` does, and usage errors named after the command typed. Arguments are
parsed only; nothing is timed."""

from __future__ import annotations

import sys

import pytest
import torch

SCRIPTS = ["attention", "em", "generation", "routing", "training"]
SEVERAL_SIZES = {"attention", "routing"}  # these time a list of batch sizes
OLD_SPELLING = {"attention": "--batches", "routing": "--batches", "em": "--batch", "generation": "--batch"}
CAST = {"attention", "em", "generation"}  # --dtype casts modules and inputs; the others autocast


def _common(module):
    """The ``_common`` module the benchmark ``module`` imported (by its bare name)."""
    return sys.modules[module.chosen_device.__module__]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_takes_batch_size(load_benchmark, script):
    """``--batches`` (attention, routing), ``--batch`` (em, generation), ``--batch-size`` (training):
    now ``--batch-size`` everywhere, a list where the script times several sizes, with a help."""
    parser = load_benchmark(script).build_parser()
    option = next(a for a in parser._actions if "--batch-size" in a.option_strings)
    assert option.dest == "batch_size" and option.help
    if script in SEVERAL_SIZES:
        assert parser.parse_args(["--batch-size", "4", "8"]).batch_size == [4, 8]
    else:
        assert parser.parse_args(["--batch-size", "4"]).batch_size == 4


@pytest.mark.parametrize("script", sorted(OLD_SPELLING))
def test_the_old_batch_spellings_parse_to_the_same_value(load_benchmark, script):
    parser = load_benchmark(script).build_parser()
    sizes = ["4", "8"] if script in SEVERAL_SIZES else ["4"]
    old = parser.parse_args([OLD_SPELLING[script], *sizes])
    assert old == parser.parse_args(["--batch-size", *sizes])
    assert old.batch_size == ([4, 8] if script in SEVERAL_SIZES else 4)
    option = next(a for a in parser._actions if "--batch-size" in a.option_strings)
    assert OLD_SPELLING[script] in option.option_strings
    assert OLD_SPELLING[script] in option.help and "old spelling" in option.help
    if script in SEVERAL_SIZES:  # --batch: argparse took it as --batches' abbreviation (diff review)
        assert parser.parse_args(["--batch", *sizes]) == old


@pytest.mark.parametrize("script", SCRIPTS)
def test_device_takes_a_cuda_index_as_the_cli_does(load_benchmark, script):
    """``cuda:1`` was refused (choices auto, cpu, cuda); parsing it needs no GPU."""
    parser = load_benchmark(script).build_parser()
    for name in ("auto", "cpu", "cuda", "cuda:0", "cuda:1"):
        assert parser.parse_args(["--device", name]).device == name


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda:", "CUDA", "cuda:-1", "mps"])
def test_a_bad_device_is_a_usage_error_naming_device(load_benchmark, capsys, script, name):
    parser = load_benchmark(script).build_parser()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--device", name])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --device: device must be auto, cpu, cuda or cuda:<index>, got {name!r}" in err


@pytest.mark.parametrize("script", SCRIPTS)
def test_chosen_device_keeps_the_cuda_index_and_checks_it_exists(load_benchmark, monkeypatch, capsys, script):
    """``cuda:1`` is that device (made torch's current one), not the CPU; an index past the last
    device is a usage error naming --device (no GPU needed: torch's answers are stubbed)."""
    module = load_benchmark(script)
    parser = module.build_parser()
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert module.chosen_device(parser, "cuda:1") == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]
    assert module.chosen_device(parser, "cuda") == torch.device("cuda")
    with pytest.raises(SystemExit) as stop:
        module.chosen_device(parser, "cuda:2")
    assert stop.value.code == 2
    assert "--device cuda:2: device 'cuda:2' requested but this machine has 2 CUDA device(s)" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_every_option_with_its_default(load_benchmark, capsys, script):
    parser = load_benchmark(script).build_parser()
    for action in parser._actions:
        assert action.help, f"{script}: {action.option_strings} has no help"
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "auto: cuda if torch sees a CUDA device, else cpu (default: auto)" in text
    assert "(default: float32)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    expected = {"attention": "(default: 1 8)", "em": "(default: 32)", "generation": "(default: 1)",
                "routing": "(default: 32 128 for dynamic", "training": "(default: 128)"}[script]
    assert expected in text
    if script != "routing":  # routing's repeats depend on --quick: its help says so
        assert "(default: 3)" in text or "(default: 7)" in text


@pytest.mark.parametrize("script", SCRIPTS)
def test_dtype_help_says_whether_it_casts_or_autocasts(load_benchmark, script):
    """``--dtype`` casts the modules and inputs in attention, em and generation, and means
    torch.autocast in routing and training: each help says which, first."""
    parser = load_benchmark(script).build_parser()
    dtype = next(a for a in parser._actions if "--dtype" in a.option_strings)
    assert dtype.help.startswith("cast:" if script in CAST else "autocast:")
    assert ("no autocast" in dtype.help) == (script in CAST)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("torchvote bench SCRIPT", "torchvote bench SCRIPT"),  # what `torchvote bench` sets
        (None, "SCRIPT.py"),  # run directly: the file's name
        ("torchvote bench other", "SCRIPT.py"),  # another script's name: not this one's
    ],
)
@pytest.mark.parametrize("script", SCRIPTS)
def test_usage_errors_name_the_command_that_ran_the_script(load_benchmark, monkeypatch, capsys, script,
                                                           given, expected):
    """Through ``torchvote bench NAME`` (which runs the script as its child) errors began
    ``NAME.py: error:``; they name the command typed."""
    module = load_benchmark(script)
    if given is None:
        monkeypatch.delenv("TORCHVOTE_BENCH_PROG", raising=False)
    else:
        monkeypatch.setenv("TORCHVOTE_BENCH_PROG", given.replace("SCRIPT", script))
    parser = module.build_parser()
    expected = expected.replace("SCRIPT", script)
    assert parser.prog == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "gpu"])
    assert f"\n{expected}: error: argument --device" in capsys.readouterr().err


def test_the_bench_command_tells_its_script_the_command_typed(capsys):
    """End to end: ``torchvote bench routing --device gpu`` runs the script as a child process."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "torchvote.cli", "bench", "routing", "--device", "gpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "torchvote bench routing: error: argument --device" in result.stderr


@pytest.mark.parametrize("cuda", [False, True])
def test_chosen_device_takes_auto_from_the_rule_of_torchvote_train(load_benchmark, monkeypatch, cuda):
    """``auto`` is decided in one place, :func:`torchvote.validation.auto_device_name`, which
    ``resolve_device`` (``torchvote train --device``) uses too; the scripts had a copy."""
    from torchvote import validation
    from torchvote.training import distributed

    common = _common(load_benchmark("attention"))
    parser = load_benchmark("attention").build_parser()
    assert common.auto_device_name is validation.auto_device_name is distributed.auto_device_name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    expected = torch.device("cuda" if cuda else "cpu")
    assert common.chosen_device(parser, "auto") == expected
    assert distributed.resolve_device("auto").type == expected.type
    told = []
    monkeypatch.setattr(common, "auto_device_name", lambda name: told.append(name) or "cpu")
    assert common.chosen_device(parser, "auto") == torch.device("cpu")  # whatever torch sees: the rule's
    assert told == ["auto"]
