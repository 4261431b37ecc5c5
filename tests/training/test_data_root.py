"""``data.root`` is kept absolute, and a resume may name another one.

A relative root (``data.root=mnist`` typed in ``my data/``) was stored as written, so ``evaluate``
and ``train --resume`` from another folder failed with "Not found: MNIST ... Looked for mnist/...";
and the absolute path given on resume was refused ("cannot resume with a different config:
data.root"): where the files lie is no property of the run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from torchvote.cli import main
from torchvote.training import find_checkpoint, load_run_config, train
from torchvote.training.checkpoint import checkpoint_name
from torchvote.training.config import config_from_dict, load_config
from torchvote.training.schema import DataConfig


def test_a_relative_root_is_made_absolute_from_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert DataConfig(root="mnist").root == str(tmp_path / "mnist")
    assert DataConfig(root=Path("a/../b")).root == str(tmp_path / "b")
    assert load_config("smoke", ["data.root=mnist"]).data.root == str(tmp_path / "mnist")


def test_an_eval_on_entrys_relative_root_is_made_absolute_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config("smoke", ["eval_on=[mnist:root=my data,source=idx, small-digits]"])
    assert config.eval_on == (f"mnist:root={tmp_path / 'my data'},source=idx", "small-digits")
    given = f"mnist:source=idx,root={tmp_path}"  # absolute already: the text as given
    assert load_config("smoke", [f"eval_on=[{given}]"]).eval_on == (given,)


def test_a_root_under_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DataConfig(root="~/mnist").root == str(tmp_path / "mnist")


def test_no_root_still_means_each_data_sets_own_place():
    assert DataConfig().root is None
    assert load_config("smoke").data.root is None


@pytest.fixture
def relative_run(tiny_mnist_root, tiny_values, tmp_path, monkeypatch):
    """A tiny run trained in ``tmp_path / "my data"`` with ``data.root=mnist``; its folder."""
    here = tmp_path / "my data"
    shutil.copytree(tiny_mnist_root, here / "mnist")
    monkeypatch.chdir(here)
    config = config_from_dict(tiny_values(Path("run"), data__root="mnist", epochs=1))
    train(config, verbose=False)
    monkeypatch.chdir(tmp_path)  # another folder from now on
    return here / "run"


def test_a_relative_root_is_saved_absolute_and_evaluate_finds_it_from_another_folder(relative_run, capsys):
    saved = yaml.safe_load((relative_run / "config.yaml").read_text())
    assert saved["data"]["root"] == str(relative_run.parent / "mnist")
    assert Path.cwd() != relative_run.parent
    assert main(["evaluate", str(relative_run)]) == 0, capsys.readouterr().err
    assert "accuracy" in capsys.readouterr().out


def test_a_resume_may_name_another_data_root(relative_run, tmp_path):
    moved = tmp_path / "moved"
    os.rename(relative_run.parent / "mnist", moved)  # the files moved: the run goes on with them
    config = load_run_config(relative_run, [f"data.root={moved}", "epochs=2"])
    assert config.data.root == str(moved)
    result = train(config, resume=relative_run, verbose=False)
    assert result.step == 2 * (240 // 40)
    assert find_checkpoint(relative_run).name == checkpoint_name(result.step)
