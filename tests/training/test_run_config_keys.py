"""Which folders read as runs depends on the keys of a run's ``config.yaml``: a TrainConfig key
added without being listed as added since the first release would make every older run folder
stopped before its first checkpoint read as "not a run folder" (a usage error for evaluate,
generate, explain and train --resume)."""

from __future__ import annotations

import dataclasses

import yaml

from torchvote.training.schema import TrainConfig
from torchvote.training.setup import _KEYS_ADDED_SINCE, is_run_config

#: The top-level keys of the first run folders' config.yaml (2026-11-27).
FIRST_RELEASE_KEYS = frozenset({
    "batch_size", "bf16", "checkpoint_every", "compile", "data", "description", "deterministic", "device",
    "epochs", "eval_batch_size", "eval_every", "eval_on", "fp16", "keep_checkpoints", "log_every", "loss",
    "max_steps", "model", "num_workers", "optim", "out_dir", "preset", "progress", "run_dir", "seed",
    "tensorboard",
})


def test_every_key_added_since_the_first_run_folders_is_listed():
    keys = {field.name for field in dataclasses.fields(TrainConfig)}
    assert keys - FIRST_RELEASE_KEYS == set(_KEYS_ADDED_SINCE), (
        "a TrainConfig key was added: list it in torchvote.training.setup._KEYS_ADDED_SINCE"
    )
    assert keys >= FIRST_RELEASE_KEYS  # a key removed: older run folders no longer read as runs


def test_a_config_of_the_first_release_keys_reads_as_a_run(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(dict.fromkeys(sorted(FIRST_RELEASE_KEYS), 1)))
    assert is_run_config(config)
    config.write_text(yaml.safe_dump(dict.fromkeys(sorted(FIRST_RELEASE_KEYS - {"seed"}), 1)))
    assert not is_run_config(config)  # a key of the first release missing: a user's own file
