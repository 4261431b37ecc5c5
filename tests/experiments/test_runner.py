"""`torchvote reproduce --variant`: a variant is named by its label or by its run folder's name."""

from __future__ import annotations

import re

import pytest

from torchvote.cli import main
from torchvote.experiments import get_row, run_dir_of, select_variants


def test_a_variant_is_chosen_by_the_folder_name_its_runs_go_to(capsys):
    # --dry-run shows runs/reproduce/router-swap/cpu/uniform-mnist/seed-0; `--variant uniform-mnist`
    # was "none of ['uniform-mnist'] is in a label of [...]"
    row = get_row("router-swap")
    for variant in row.variants:
        folder = run_dir_of("runs", row, "cpu", variant, 0).parent.name
        assert select_variants(row, [folder]) == [variant]  # every folder names one variant
    assert main(["reproduce", "router-swap", "--dry-run", "--variant", "uniform-mnist", "--seeds", "0"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("run_dir=runs/reproduce/router-swap/cpu/uniform-mnist/seed-0")


def test_a_label_still_chooses_what_it_chose():
    row = get_row("router-swap")
    texts = ("MNIST", "uniform / MNIST")
    by_label = {text: [v.label for v in select_variants(row, [text])] for text in texts}
    assert by_label["uniform / MNIST"] == ["uniform / MNIST"]
    # a plain substring test of the labels, written out
    assert by_label["MNIST"] == [v.label for v in row.variants if "MNIST" in v.label]


@pytest.mark.parametrize("text", ["nothing", "!!", "uniform--cifar"])  # "!!": no slug, matches nothing
def test_a_text_that_names_no_variant_is_refused(text):
    with pytest.raises(ValueError, match="variants: none of"):
        select_variants(get_row("router-swap"), [text])


def test_one_string_of_variants_is_refused_not_read_as_its_characters():
    # select_variants(row, "uniform") matched every label holding a 'u', an 'n', ...: 26 of 26
    # variants of router-swap, where the user meant the 2 uniform ones, would have trained
    row = get_row("router-swap")
    single = r"variants must be a list of strings, got the single string 'uniform' \(give \['uniform'\]\)"
    with pytest.raises(TypeError, match=single):
        select_variants(row, "uniform")
    with pytest.raises(TypeError, match="got None in it"):
        select_variants(row, [None])
    assert [v.label for v in select_variants(row, ("uniform",))] == [
        v.label for v in row.variants if "uniform" in v.label
    ]


def test_train_command_refuses_what_the_run_would_refuse():
    from torchvote.experiments import train_command

    row, other = get_row("capsnet-routing"), get_row("router-swap")
    variant = row.variants[0]
    for seed, error in ((-1, ValueError), (1.5, TypeError), ("0; rm -rf /", TypeError)):
        with pytest.raises(error, match=re.escape("seed must be an integer in [0, 2**64)")):
            train_command(row, variant, "cpu", seed)
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda"):
        train_command(row, variant, "cpu", 0, device="gpu")
    with pytest.raises(ValueError, match="is not one of capsnet-routing's"):
        train_command(row, other.variants[0], "cpu", 0)
    with pytest.raises(ValueError, match="trains nothing"):
        train_command(get_row("pretrained-routing"), variant, "cpu", 0)
    assert train_command(row, variant, "cpu", 2).startswith(f"torchvote train {variant.preset} ")


def test_rows_variants_and_metrics_check_their_fields():
    from torchvote.experiments import Metric, Row, Variant

    with pytest.raises(ValueError, match="transform must be one of"):
        Metric("error", transform="error-percent")  # read the raw accuracy as the error before
    with pytest.raises(TypeError, match="overrides must be a list of strings"):
        Variant("one", "capsnet-mnist", overrides="epochs=1")  # was one override per character
    assert Variant("one", "capsnet-mnist", overrides=["epochs=1"]).overrides == ("epochs=1",)
    with pytest.raises(ValueError, match="seeds must be a positive integer"):
        Row("r", "z", "title", seeds=-1)


def test_an_out_dir_that_is_no_path_is_named():
    from torchvote.experiments import check_request

    with pytest.raises(TypeError, match=r"out_dir \(--out\): expected a path \(str or os.PathLike\)"):
        check_request(get_row("capsnet-routing"), budget="cpu", seeds=None, device="auto", out_dir=None,
                      variants=())


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_measuring_row_refuses_a_device(tmp_path, device):
    """A measuring row measures on the CPU: a --device other than cpu would be ignored, so it is
    refused (mutation review)."""
    from torchvote.experiments import check_request

    row = get_row("pretrained-routing")
    with pytest.raises(ValueError, match="--device: pretrained-routing trains nothing"):
        check_request(row, budget="cpu", seeds=None, device=device, out_dir=tmp_path, variants=())
    on_the_cpu = check_request(row, budget="cpu", seeds=None, device="cpu", out_dir=tmp_path, variants=())
    assert on_the_cpu == ([], [])


def test_reproduce_plans_in_the_folder_it_checked(tmp_path, monkeypatch, capsys):
    """--out=~/rep was checked with '~' expanded but planned in a folder named '~'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["reproduce", "capsnet-routing", "--dry-run", "--out", "~/rep", "--seeds", "0"]) == 0
    planned = [line for line in capsys.readouterr().out.splitlines() if "run_dir=" in line]
    assert planned and all(f"run_dir={tmp_path}/rep/capsnet-routing/cpu/" in line for line in planned)


def test_reproduce_refuses_an_empty_out_and_lists_one_row_under_its_budget(capsys):
    """--out '' planned every run in the working folder; --list NAME --budget paper printed every
    row, NAME and --budget ignored."""
    assert main(["reproduce", "router-swap", "--dry-run", "--out", ""]) == 2
    assert "out_dir (--out): expected a path, got an empty string" in capsys.readouterr().err
    row = get_row("router-swap")
    for budget in ("cpu", "paper"):
        assert main(["reproduce", "--list", "router-swap", "--budget", budget]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("f  router-swap: ")
        assert lines[1] == f"{len(row.variants)} of {len(row.variants)} variants x 3 seeds (budget {budget}):"
        assert len(lines) == 2 + len(row.variants)
        first = row.variants[0]
        expected = " ".join(item for item in row.overrides(first, budget, 0) if item != "seed=0")
        assert lines[2].split(None, len(first.label.split()))[-1] == f"{first.preset} {expected}"
    assert main(["reproduce", "--list", "router-swap", "--variant", "uniform"]) == 0  # as a run chooses
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 3 and all(line.split()[0] == "uniform" for line in lines[2:])


def test_reproduce_list_of_a_row_honours_and_checks_seeds_and_refuses_dry_run(capsys):
    """--list NAME counted the row's default seeds whatever --seeds said, and took seeds a run
    refuses and --dry-run, silently."""
    row = get_row("router-swap")
    assert main(["reproduce", "--list", "router-swap", "--seeds", "4", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"{len(row.variants)} of {len(row.variants)} variants x seeds 4 7 (budget cpu):"
    assert main(["reproduce", "--list", "router-swap", "--seeds", "1", "1"]) == 2
    assert "seeds must be distinct" in capsys.readouterr().err
    assert main(["reproduce", "--list", "router-swap", "--dry-run"]) == 2
    assert "--list and --dry-run: give one" in capsys.readouterr().err
    assert main(["reproduce", "--list", "router-swap", "--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err
