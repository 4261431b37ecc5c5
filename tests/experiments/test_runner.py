"""`torchvote reproduce --variant`: a variant is named by its label or by its run folder's name."""

from __future__ import annotations

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
