"""Configs: presets, dotted overrides checked against the dataclass field types, clear errors."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

import pytest
import yaml

from torchvote.training.config import (
    ConfigError,
    DataConfig,
    LossConfig,
    OptimConfig,
    TrainConfig,
    apply_overrides,
    coerce_value,
    config_diff,
    config_from_dict,
    config_to_dict,
    list_presets,
    load_config,
    load_preset,
    parse_override,
)


def test_defaults_build_a_valid_config():
    config = load_config()
    assert isinstance(config, TrainConfig)
    assert config.model.name == "cnn-baseline" and config.optim.name == "adam"


@pytest.mark.parametrize("name", sorted(list_presets()))
def test_every_shipped_preset_loads_and_has_a_description(name):
    config = load_config(name)
    assert config.description
    assert config_from_dict(config_to_dict(config)) == config


def test_main_preset_exists():
    assert "main" in list_presets()


def test_overrides_of_every_kind_are_typed():
    config = apply_overrides(
        load_config(),
        [
            "epochs=3",
            "optim.lr=3e-4",
            "bf16=true",
            "progress=off",
            "optim.name=sgd",
            "max_steps=none",
            "optim.grad_clip=1.5",
            "data.name=mnist",
            "eval_on=affnist,multimnist",
            "model.preset=small",
            "model.dropout=0.25",
            "model.channels=8,16",
            "model.pool_after=[0]",
            "data.options.size=300",
            "data.options.source=idx",
            "batch_size=1_024",
        ],
    )
    assert config.epochs == 3 and config.optim.lr == pytest.approx(3e-4) and config.bf16 is True
    assert config.progress is False and config.optim.name == "sgd" and config.max_steps is None
    assert config.optim.grad_clip == 1.5 and config.eval_on == ("affnist", "multimnist")
    assert config.model.preset == "small" and config.batch_size == 1024
    assert config.model.overrides == {"dropout": 0.25, "channels": (8, 16), "pool_after": (0,)}
    assert config.data.options == {"size": 300, "source": "idx"}


def test_model_name_can_come_after_model_overrides():
    config = apply_overrides(load_config(), ["model.dropout=0.1", "model.name=cnn-baseline"])
    assert config.model.overrides == {"dropout": 0.1}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lrr=1", "unknown key 'optim.lrr' (did you mean 'optim.lr'?); valid keys: optim.name,"),
        (
            "epoch=2",
            "unknown key 'epoch' (did you mean 'epochs'?); valid keys: description, preset, model, data, "
            "optim, loss, batch_size",
        ),
        # a key of a section given at the top level: the section's key is named (the list alone did not)
        ("lr=0.01", "unknown key 'lr' (did you mean 'optim.lr'?); valid keys: description,"),
        ("eval_limit=5", "unknown key 'eval_limit' (did you mean 'data.eval_limit'?); valid keys:"),
        ("zzz=1", "unknown key 'zzz'; valid keys: description,"),  # nothing close: no guess
        ("epochs=two", "epochs: expected int, got 'two'"),
        ("epochs=2.5", "epochs: expected int, got '2.5'"),
        ("optim.lr=fast", "optim.lr: expected float, got 'fast'"),
        ("bf16=maybe", "bf16: expected bool, got 'maybe'"),
        ("optim.name=rmsprop", "optim.name: 'rmsprop' is not one of: adam, adamw, sgd"),
        (
            "optim.schedule=linear",
            "optim.schedule: 'linear' is not one of: constant, exponential, cosine, onecycle",
        ),
        ("max_steps=many", "max_steps: expected int | none, got 'many'"),
        (
            "model.widht=3",
            "unknown key 'model.widht' for model 'cnn-baseline'; valid keys: model.name, model.preset,",
        ),
        ("model.dropout=high", "model.dropout: expected float, got 'high'"),
        ("model.channels=8,x", "model.channels[1]: expected int, got 'x'"),
        ("model.name=capsnet9", "model.name: unknown model 'capsnet9'; models: "),
        ("model.preset=huge", "unknown preset 'huge' for model 'cnn-baseline'; presets: paper, small, tiny"),
        ("model.dropout=1.5", "dropout must be in [0, 1), got 1.5"),
        ("optim=adam", "optim is a section; set one of its keys: optim.name, optim.lr"),
        # the model's own fields, not model.overrides (how they are stored)
        ("model=capsnet", "model is a section; set one of its keys: model.name, model.preset, model.image"),
        ("epochs.x=1", "epochs is not a section; cannot set epochs.x"),
        ("epochs", "expected key=value (e.g. optim.lr=3e-4), got 'epochs'"),
        ("=3", "expected key=value"),
        ("batch_size=0", "batch_size must be a positive integer, got 0"),
        ("data.limit=0", "data.limit must be a positive integer or None, got 0"),
        ("data.limit=-5", "data.limit must be a positive integer or None, got -5"),
        ("data.eval_limit=0", "data.eval_limit must be a positive integer or None, got 0"),
        ("max_steps=0", "max_steps must be a positive integer or None, got 0"),
        ("device=tpu", "device must be auto, cpu, cuda or cuda:<index>, got 'tpu'"),
        ("device=cuda:x", "device must be auto, cpu, cuda or cuda:<index>, got 'cuda:x'"),
        ("loss.label_smoothing=1", "loss.label_smoothing must be in [0, 1)"),
        # real-valued options that trained on silently (inf, a clip that flips the gradients,
        # a reconstruction term switched off by a sign) or failed deep (decay_steps=0)
        ("optim.lr=inf", "optim.lr must be a finite number in (0.0, inf), got inf"),
        ("optim.lr=nan", "optim.lr must be a finite number in (0.0, inf), got nan"),
        ("optim.lr=0", "optim.lr must be a finite number in (0.0, inf), got 0.0"),
        ("optim.grad_clip=-1", "optim.grad_clip must be a finite number in (0.0, inf), got -1.0"),
        ("optim.grad_clip=0", "optim.grad_clip must be a finite number in (0.0, inf)"),
        ("optim.decay_steps=0", "optim.decay_steps must be a positive integer, got 0"),
        ("optim.decay_rate=-0.5", "optim.decay_rate must be a finite number in (0.0, inf)"),
        ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio must be a finite number in [0.0, 1.0]"),
        ("optim.momentum=1", "optim.momentum must be a finite number in [0.0, 1.0)"),
        ("optim.beta2=1.5", "optim.beta2 must be a finite number in [0.0, 1.0)"),
        ("optim.weight_decay=-1e-4", "optim.weight_decay must be a finite number in [0.0, inf)"),
        ("loss.reconstruction_weight=-0.0005", "loss.reconstruction_weight must be a finite number"),
        ("loss.reconstruction_weight=nan", "loss.reconstruction_weight must be a finite number"),
        ("loss.positive_margin=-0.9", "loss.positive_margin must be a finite number in (0.0, 1.0]"),
        ("loss.negative_margin=0.95", "loss.negative_margin must be below loss.positive_margin"),
        ("loss.down_weight=-0.5", "loss.down_weight must be a finite number in [0.0, inf)"),
        ("loss.spread_margin_end=2", "loss.spread_margin_end must be a finite number in (0.0, 1.0]"),
        ("loss.spread_ramp_steps=0", "loss.spread_ramp_steps must be a positive integer or None, got 0"),
        ("seed=-1", "seed must be an integer in [0, 2**64), got -1"),
    ],
)
def test_bad_overrides_say_what_is_valid(override, message):
    with pytest.raises(ConfigError) as error:
        apply_overrides(load_config(), [override])
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainConfig(epochs=2.5), "epochs must be a positive integer, got 2.5"),
        (lambda: TrainConfig(batch_size=True), "batch_size must be a positive integer, got True"),
        (lambda: TrainConfig(keep_checkpoints=2.0), "keep_checkpoints must be a positive integer, got 2.0"),
        (lambda: TrainConfig(log_every=True), "log_every must be a positive integer, got True"),
        (lambda: TrainConfig(max_steps=2.5), "max_steps must be a positive integer or None, got 2.5"),
        (lambda: TrainConfig(max_steps=True), "max_steps must be a positive integer or None, got True"),
        (
            lambda: TrainConfig(data=DataConfig(limit=True)),
            "data.limit must be a positive integer or None, got True",
        ),
        (
            lambda: TrainConfig(optim=OptimConfig(decay_steps=2.5)),
            "optim.decay_steps must be a positive integer, got 2.5",
        ),
        (
            lambda: TrainConfig(loss=LossConfig(spread_ramp_steps=1.5)),
            "loss.spread_ramp_steps must be a positive integer or None, got 1.5",
        ),
        (
            lambda: dataclasses.replace(TrainConfig(), epochs=0.5),
            "epochs must be a positive integer, got 0.5",
        ),
    ],
)
def test_a_config_built_in_python_refuses_floats_and_bools_for_counts(build, message):
    """``load_config`` checks every value against its field's type, but a dataclass built in
    Python skips that check: ``__post_init__`` refused only values <= 0, so 2.5 epochs or a batch
    size of ``True`` (1) went through."""
    with pytest.raises(ConfigError) as error:
        build()
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        # each was accepted; what train() then did is in the comment
        (lambda: OptimConfig(weight_decay_on="bias"), "optim.weight_decay_on must be one of 'all'"),
        (lambda: OptimConfig(name="rmsprop"), "optim.name must be one of 'adam', 'adamw', 'sgd'"),
        (lambda: OptimConfig(schedule="linear"), "optim.schedule must be one of"),  # "has no multiplier"
        (lambda: OptimConfig(lr=-1.0), "optim.lr must be a finite number in (0.0, inf)"),  # torch's error
        (lambda: OptimConfig(decay_steps=0), "optim.decay_steps must be a positive integer"),  # ZeroDivision
        (lambda: LossConfig(name="mse"), "loss.name must be one of"),  # a bare KeyError: 'mse'
        (lambda: LossConfig(label_smoothing=2.0), "loss.label_smoothing must be in [0, 1)"),
        (lambda: LossConfig(positive_margin=-1.0), "loss.positive_margin"),
        (lambda: TrainConfig(bf16="yes"), "bf16 must be True or False, got 'yes'"),  # truthy: on
        (lambda: TrainConfig(eval_on="small-digits"), "eval_on must be a list of strings"),  # data set 's'
        (lambda: TrainConfig(run_dir=5), "run_dir must be a string or None, got 5"),  # a pathlib error
        (lambda: TrainConfig(description=None), "description must be a string, got None"),
        (lambda: TrainConfig(data=DataConfig(canvas=-1)), "data.canvas must be a positive integer or None"),
        (lambda: TrainConfig(model={"name": "capsnet"}), "ModelConfig expected for that section, got dict"),
    ],
)
def test_a_config_built_in_python_is_checked_as_a_loaded_one(build, message):
    with pytest.raises(ConfigError) as error:
        build()
    assert message in str(error.value)


def test_a_section_changed_after_it_was_built_is_checked_with_the_run_config():
    optim = OptimConfig()
    optim.weight_decay_on = "bias"
    with pytest.raises(ConfigError, match="optim.weight_decay_on must be one of"):
        TrainConfig(optim=optim)


def test_paths_from_python_are_taken_as_the_folders_they_name(tmp_path):
    config = TrainConfig(out_dir=tmp_path, run_dir=tmp_path / "run", data=DataConfig(root=tmp_path))
    expected = (str(tmp_path), str(tmp_path / "run"), str(tmp_path))
    assert (config.out_dir, config.run_dir, config.data.root) == expected


def test_overrides_given_as_one_string_are_refused():
    with pytest.raises(ConfigError, match="a list of strings, got the single string 'epochs=2'"):
        apply_overrides(TrainConfig(), "epochs=2")  # was: "expected key=value ..., got 'e'"
    with pytest.raises(ConfigError, match="overrides must be a list of strings, got 3 in it"):
        apply_overrides(TrainConfig(), [3])  # was: an AttributeError


@pytest.mark.parametrize("override", ["epochs=2.5", "batch_size=true", "max_steps=2.5", "data.limit=true"])
def test_the_command_line_refuses_floats_and_bools_for_counts_by_their_type(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: expected int"):
        load_config("smoke", [override])


def test_parse_override_splits_the_dotted_key():
    assert parse_override("model.num_routing=2") == (["model", "num_routing"], "2")
    assert parse_override(" optim.lr = 1e-3 ") == (["optim", "lr"], "1e-3")


@pytest.mark.parametrize(
    ("value", "annotation", "expected"),
    [
        ("3", int, 3),
        (3, int, 3),
        ("1e-3", float, 1e-3),
        (2, float, 2.0),
        ("yes", bool, True),
        ("0", bool, False),
        (True, bool, True),
        ("a", Literal["a", "b"], "a"),
        ("null", int | None, None),
        (None, str | None, None),
        ("7", int | None, 7),
        ([1, 2], tuple[int, ...], (1, 2)),
        ("(1, 2)", tuple[int, ...], (1, 2)),
        ("1,x", tuple[int, str], (1, "x")),
    ],
)
def test_coerce_value_accepts_strings_and_yaml_values(value, annotation, expected):
    assert coerce_value(value, annotation, "key") == expected


@pytest.mark.parametrize(
    ("value", "annotation"),
    [
        (True, int),
        (1.5, int),
        ("2", bool),
        (3, str),
        ("c", Literal["a", "b"]),
        ([1, "x"], tuple[int, ...]),
        ("1,2,3", tuple[int, int]),
    ],
)
def test_coerce_value_rejects_wrong_types(value, annotation):
    with pytest.raises(ConfigError, match="key"):
        coerce_value(value, annotation, "key")


def test_yaml_files_are_checked_like_overrides(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "cnn-baseline", "dropout": "high"}}))
    with pytest.raises(ConfigError, match="model.dropout: expected float, got 'high'"):
        load_config(str(path))
    path.write_text(yaml.safe_dump({"optim": {"nam": "adam"}}))
    with pytest.raises(ConfigError, match="unknown key 'optim.nam'"):
        load_config(str(path))
    path.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(str(path))
    path.write_text("model: capsnet\n")  # its message listed model.overrides, no key of a file
    with pytest.raises(ConfigError, match=r"model is a section, got 'capsnet'; set its keys: model\.name, "):
        load_config(str(path))
    path.write_text(yaml.safe_dump({"epochs": 4, "model": {"preset": "tiny", "hidden": [16]}}))
    config = load_config(str(path), ["epochs=5"])
    assert config.epochs == 5 and config.model.overrides == {"hidden": (16,)}


def test_unknown_preset_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'nope'; presets: .*main.*smoke"):
        load_preset("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_preset(str(tmp_path / "missing.yaml"))


def test_config_diff_names_the_changed_keys():
    a = load_config()
    b = apply_overrides(a, ["optim.lr=0.5", "model.dropout=0.1"])
    # the model's values as it builds them: the run's dropout is the model's default, 0.5
    assert config_diff(a, b) == {"model.dropout": (0.5, 0.1), "optim.lr": (0.001, 0.5)}


def test_config_diff_compares_the_model_a_preset_and_its_overrides_build():
    """A run of preset tiny (d_model 32) given model.d_model=32 was refused on resume as
    "model.d_model (run: None, now: 32)": the same model. A real change names the run's value."""
    from torchvote.models.registry import build_config

    run = load_config("lm-shakespeare")
    width = build_config(run.model.name, run.model.preset).d_model
    assert config_diff(run, apply_overrides(run, [f"model.d_model={width}"])) == {}
    assert config_diff(run, apply_overrides(run, [f"model.d_model={2 * width}"])) == {
        "model.d_model": (width, 2 * width)
    }
    # a field the data fill is compared as given: built without the data, an override of
    # image_size=28 (a 28-pixel model on 8x8 digits) and none (8 from the data) looked alike
    digits = load_config("smoke")
    wide = apply_overrides(digits, ["model.image_size=28"])
    assert config_diff(wide, digits) == {"model.image_size": (28, None)}
    # another preset that builds other sizes differs in those fields, not in its name
    other = apply_overrides(run, ["model.preset=tiny"])
    changed = config_diff(run, other)
    assert changed and all(key.startswith("model.") and key != "model.preset" for key in changed)
    assert changed == {
        f"model.{name}": (getattr(build_config(run.model.name, run.model.preset), name), value)
        for name, value in vars(build_config(run.model.name, "tiny")).items()
        if value != getattr(build_config(run.model.name, run.model.preset), name)
    }


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.router_options.agreement=cosine", "model.router_options.bias=true"],
        ["model.router_options={agreement: cosine, bias: true}"],
        ["model.router_options={agreement:cosine,bias:true}"],
        [
            "model.router_options={agreement: dot}",
            "model.router_options.agreement=cosine",
            "model.router_options.bias=1",
        ],
    ],
)
def test_dict_fields_are_settable_from_the_command_line(overrides):
    config = load_config("capsnet-mnist", overrides)
    assert config.model.overrides["router_options"] == {"agreement": "cosine", "bias": True}


def test_a_router_option_the_layer_passes_is_a_clear_value_error():
    with pytest.raises(ConfigError, match=r"router_options must not set \['iterations'\]"):
        load_config("capsnet-mnist", ["model.router_options={iterations: 2}"])
    with pytest.raises(ConfigError, match="model.router_options: expected dict, got 3"):
        load_config("capsnet-mnist", ["model.router_options=3"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("bf16=2", "bf16: expected bool, got '2'"),
        ("description=", None),
        ("eval_on=[affnist-style:canvas=28, mnist]", None),
        ("data.eval_limit=null", None),
        ("model.widht.x=3", "unknown key 'model.widht' for model 'cnn-baseline'; valid keys: model.name,"),
        ("data.options={size: 300, source: idx}", None),
        ("checkpoint_every=-1", "checkpoint_every must be an integer >= 0, got -1"),
    ],
)
def test_more_overrides_are_typed_or_say_what_is_wrong(override, message):
    if message is None:
        apply_overrides(load_config(), [override])
        return
    with pytest.raises(ConfigError) as error:
        apply_overrides(load_config(), [override])
    assert message in str(error.value)


def test_one_reader_for_every_key_value_of_the_command_line():
    from torchvote.training.evaluation import parse_eval_entry
    from torchvote.training.keyvalue import parse_options, parse_value

    config = load_config(None, ["eval_on=[affnist-style:canvas=28]", "data.options.canvas=28"])
    # the same comma reader as `evaluate --on`: an entry keeps all its options, with or without []
    for text in ("mnist,affnist-style:canvas=28,seed=1", "[mnist, affnist-style:canvas=28,seed=1]"):
        assert load_config(None, [f"eval_on={text}"]).eval_on == ("mnist", "affnist-style:canvas=28,seed=1")
    assert load_config(None, ["eval_on=affnist,multimnist"]).eval_on == ("affnist", "multimnist")
    name, options = parse_eval_entry(config.eval_on[0])
    assert (name, options) == ("affnist-style", config.data.options)
    assert parse_options(["canvas=28", "split=test", "scale=1e-3"], "--data-option") == {
        "canvas": 28, "split": "test", "scale": 1e-3
    }
    assert parse_value("{iterations:2}") == {"iterations": 2} == parse_value("{iterations: 2}")
    with pytest.raises(ConfigError, match="--data-option: options must be key=value, got 'canvas'"):
        parse_options(["canvas"], "--data-option")


def test_options_joined_with_colons_are_refused_naming_the_comma(capsys):
    """mnist:split=train:limit=5 was refused as a split 'train:limit=5' (or ran with the wrong
    value of a free-form option); options are separated by commas."""
    from torchvote.cli import main
    from torchvote.training.keyvalue import parse_entry

    with pytest.raises(ConfigError, match="separate its options with commas, not colons"):
        parse_entry("mnist:split=train:limit=5", "--on")
    with pytest.raises(ConfigError, match=r"eval_on entry .*separate its options with commas"):
        load_config("smoke", ["eval_on=[affnist-style:canvas=28:seed=3]"])
    # in any option, not only the first, and with a space after the colon (mutation review)
    for joined in ("mnist:limit=5,split=train:seed=3", "mnist:split=train: limit=5", "mnist:split:limit=5"):
        with pytest.raises(ConfigError, match="separate its options with commas, not colons"):
            parse_entry(joined, "--on")
    assert parse_entry("mnist:split=train,limit=5", "--on") == ("mnist", {"split": "train", "limit": 5})
    # a colon inside a mapping value is no separator
    assert parse_entry("affnist-style:ranges={shear: [0, 0]}", "--on")[1] == {"ranges": {"shear": [0, 0]}}
    assert main(["evaluate", "no-such-run", "--on", "mnist:split=train:limit=5"]) == 2
    assert "commas, not colons" in capsys.readouterr().err


def test_an_empty_on_is_refused_not_read_as_the_runs_own_sets(capsys):
    """--on "$UNSET" (or ",") evaluated on the run's own data sets in silence."""
    from torchvote.cli import main

    for empty in ("", ",", " "):
        assert main(["evaluate", "no-such-run", "--on", empty]) == 2  # before the checkpoint is looked for
        assert "--on names no data set" in capsys.readouterr().err


def test_an_option_given_twice_is_refused_not_settled_by_order(capsys):
    """seed=3,seed=4 in an --on / eval_on entry, or two --data-option seed=, ran with seed 4 in
    silence, where a training override given twice is refused."""
    from torchvote.cli import main
    from torchvote.training.keyvalue import parse_entry, parse_options

    with pytest.raises(ConfigError, match="--data-option: seed is given twice; give each option once"):
        parse_options(["seed=3", "seed=4"], "--data-option")
    with pytest.raises(ConfigError, match="entry 'affnist-style:seed=3,seed=4': seed is given twice"):
        parse_entry("affnist-style:seed=3,seed=4", "--on")
    with pytest.raises(ConfigError, match="seed is given twice"):
        load_config("smoke", ["eval_on=[affnist-style:canvas=28,seed=3,seed=4]"])
    argv = ["evaluate", "no-such-run", "--on", "affnist-style"]
    argv += ["--data-option", "seed=1", "--data-option", "seed=2"]
    assert main(argv) == 2  # before the checkpoint is looked for
    assert "--data-option: seed is given twice" in capsys.readouterr().err


def test_a_key_below_a_model_value_is_not_a_section():
    with pytest.raises(ConfigError, match="model.dropout is not a section; cannot set model.dropout.x"):
        apply_overrides(load_config(), ["model.dropout=0.1", "model.dropout.x=1"])


# --- the loss of a run: auto follows the router, an explicit name wins ------------------------------


def _run_loss(config: TrainConfig) -> str:
    from torchvote.models.registry import get_model_spec
    from torchvote.training.config import build_model_config, resolve_loss_name

    model_config = build_model_config(config.model)
    return resolve_loss_name(config.loss.name, get_model_spec(config.model.name), model_config)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "margin"),  # dynamic routing: the model's registered loss
        (["model.router=em"], "spread"),  # EM activations: the spread loss
        (["model.router=em", "loss.name=margin"], "margin"),  # an explicit choice wins
        (["loss.name=margin", "model.router=em"], "margin"),  # in either order
        (["model.router=em", "loss.name=cross-entropy"], "cross-entropy"),
        (["model.router=self_attention"], "margin"),
        (["model.scores=linear"], "cross-entropy"),  # logits (Tsai et al. 2020): cross-entropy
        (["model.router=em", "model.scores=linear"], "cross-entropy"),  # the scorer, not EM, scores
        (["model.scores=linear", "loss.name=margin"], "margin"),
    ],
)
def test_the_loss_follows_the_router_unless_the_command_line_names_one(overrides, expected):
    config = load_config("capsnet-mnist", overrides)
    assert _run_loss(config) == expected
    # the recorded config keeps what the user said (auto when nothing), so it re-resolves the same
    assert config_from_dict(config_to_dict(config)) == config
    assert config.loss.name == ("auto" if not any(o.startswith("loss.name") for o in overrides) else expected)


@pytest.mark.parametrize("preset", ["capsnet-mnist", "capsnet-paper", "efficient-capsnet-mnist", "main"])
def test_every_single_label_capsule_preset_trains_em_with_the_spread_loss(preset):
    """Three presets named the margin loss: model.router=em kept it there, in silence (only
    capsnet-mnist left it to the router). MultiMNIST's names it on purpose (two labels)."""
    assert _run_loss(load_config(preset)) == "margin"
    assert _run_loss(load_config(preset, ["model.router=em"])) == "spread"


def test_a_run_made_with_the_loss_a_preset_now_leaves_to_the_model_is_the_same_run():
    """The presets that named the margin loss now say auto (the same loss for dynamic routing):
    config_diff counted loss.name as changed, and reproduce and --resume refused every run made
    before, as "run with another configuration"."""
    from torchvote.training.config import config_diff

    assert config_diff(load_config("main", ["loss.name=margin"]), load_config("main")) == {}
    assert config_diff(load_config("main", ["loss.name=spread"]), load_config("main")) == {
        "loss.name": ("spread", "auto")
    }
    em = ["model.router=em"]  # auto is the spread loss there: margin is another loss
    assert "loss.name" in config_diff(load_config("main", [*em, "loss.name=margin"]), load_config("main", em))


def test_the_loss_named_in_a_yaml_wins_over_the_router(tmp_path):
    path = tmp_path / "em-margin.yaml"
    model = {"name": "capsnet", "preset": "tiny", "router": "em"}
    path.write_text(yaml.safe_dump({"model": model, "loss": {"name": "margin"}}))
    assert _run_loss(load_config(str(path))) == "margin"
    path.write_text(yaml.safe_dump({"model": model}))
    assert _run_loss(load_config(str(path))) == "spread"
    # a router set after the config was built still decides (nothing was resolved at load time)
    assert _run_loss(apply_overrides(load_config("capsnet-mnist"), ["model.router=em"])) == "spread"
    assert _run_loss(load_config("em-capsnet-mnist", ["loss.name=auto"])) == "spread"


def test_the_capsnet_preset_leaves_the_loss_to_the_router_and_says_so():
    text = load_preset("capsnet-mnist")
    assert "name" not in text["loss"]  # auto: margin for dynamic routing, spread for em
    from torchvote.training.config import _preset_dir

    comment = (_preset_dir() / "capsnet-mnist.yaml").read_text(encoding="utf-8")
    assert "model.router=em" in comment and "loss.name=margin" in comment
    assert "use loss.name=spread" not in comment  # no longer needed by hand


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (["mnist"], ["mnist"]),
        (["mnist,affnist-style"], ["mnist", "affnist-style"]),
        (["mnist, affnist-style:canvas=28,seed=1", "copy"],
         ["mnist", "affnist-style:canvas=28,seed=1", "copy"]),
        (["affnist-style:canvas=28", "seed=1"], ["affnist-style:canvas=28,seed=1"]),  # repeated --on
        (["copy:max_len=6,mnist"], ["copy:max_len=6", "mnist"]),
        (["a=1,mnist"], ["a=1", "mnist"]),  # nothing to continue: kept, and rejected as a name later
        ([" , ,"], []),
        # a list or a mapping keeps its commas (the warp off: "cannot read '{rotation_deg: [0'")
        (["mnist,affnist-style:ranges={rotation_deg: [0, 0], shear: [0, 0]},seed=1"],
         ["mnist", "affnist-style:ranges={rotation_deg: [0, 0], shear: [0, 0]},seed=1"]),
        (["affnist-style:seed=1", "ranges={scale: [1, 1]}"], ["affnist-style:seed=1,ranges={scale: [1, 1]}"]),
        (["copy:tag='a,b',mnist"], ["copy:tag='a,b'", "mnist"]),
    ],
)
def test_split_entries_keeps_options_with_their_data_set(values, expected):
    from torchvote.training.keyvalue import split_entries

    assert split_entries(values) == expected


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # found when the run reached them, as "name: unknown data set 'x'; known: [...]"
        ("data.name=cifar", "data.name: unknown data set 'cifar'; data sets: addition, affnist"),
        ("data.eval_name=cifar", "data.eval_name: unknown data set 'cifar'; data sets: "),
        ("data.eval_split=dev", "data.eval_split: 'dev' is not a split of 'small-digits'; splits: train"),
        # checked by the CLI only: a config built in Python failed when the run reached it
        ("eval_on=[mnist,cifar]", "eval_on entry 'cifar': unknown data set 'cifar'; data sets: addition"),
        # an unclosed bracket made a data set named '[mnist'
        ("eval_on=[mnist", "eval_on: expected comma-separated strs, got '[mnist' (unbalanced brackets)"),
        ("eval_on=mnist]", "eval_on: expected comma-separated strs, got 'mnist]'"),
        # an unreadable mapping was a yaml.parser.ParserError traceback
        ("data.options={size: 3", "data.options: cannot read '{size: 3' as a value"),
        ("data.options.size={a:", "data.options.size: cannot read '{a:' as a value"),
        # OmegaConf's own message did not say which key
        ("optim.lr=${nothing}", "optim.lr: Interpolation key 'nothing' not found"),
        # torch.manual_seed's "Overflow when unpacking long long", at the first step
        (f"seed={2**64}", f"seed must be an integer in [0, 2**64), got {2**64}"),
    ],
)
def test_audit_values_are_refused_at_load_naming_their_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config("smoke", [override])
    assert message in str(error.value)


def test_interpolations_resolve_when_the_config_loads():
    """OmegaConf's ``${key}`` and ``${oc.env:NAME}`` are resolved once, at load: the config (and
    so the run's saved copy) holds the values, not the expressions."""
    config = load_config("smoke", ["seed=7", "out_dir=runs/seed-${seed}"])
    assert config.out_dir == "runs/seed-7"
    assert config_to_dict(config)["out_dir"] == "runs/seed-7"


def test_the_largest_seed_torch_takes_loads():
    assert load_config("smoke", [f"seed={2**64 - 1}"]).seed == 2**64 - 1


def test_an_entrys_option_may_be_a_list_or_a_mapping():
    from torchvote.training.keyvalue import parse_entry

    entry = "affnist-style:ranges={rotation_deg: [0, 0], shear: [-0.1, 0.1]},seed=3,canvas=40"
    assert parse_entry(entry, "--on") == (
        "affnist-style", {"ranges": {"rotation_deg": [0, 0], "shear": [-0.1, 0.1]}, "seed": 3, "canvas": 40}
    )


def test_an_unreadable_value_names_its_key_wherever_it_is_read():
    from torchvote.training.keyvalue import parse_entry, parse_options, parse_value

    with pytest.raises(ConfigError, match=r"^x: cannot read '\[1, 2' as a value"):
        parse_value("[1, 2", "x")
    with pytest.raises(ConfigError, match=r"^--data-option: ranges: cannot read"):
        parse_options(["ranges={a: 1"], "--data-option")
    with pytest.raises(ConfigError, match=r"^eval_on entry 'affnist-style:ranges=\[1': ranges: cannot read"):
        parse_entry("affnist-style:ranges=[1", "eval_on")
    with pytest.raises(ConfigError, match=r"^model.router_options: cannot read"):
        load_config("capsnet-mnist", ["model.router_options={iterations: 2"])


def test_a_preset_file_without_the_suffix_is_named_by_its_stem(tmp_path):
    """Its whole path was the preset's name, and the run folder <out_dir>/<preset>-<time> was then
    the file's path plus a time (an absolute path ignores out_dir)."""
    path = tmp_path / "configs" / "mine"
    path.parent.mkdir()
    path.write_text("epochs: 3\n")
    config = load_config(str(path))
    assert config.epochs == 3 and config.preset == "mine"
    yaml_path = tmp_path / "configs" / "other.yml"
    yaml_path.write_text("epochs: 2\n")
    assert load_config(str(yaml_path)).preset == "other"
    assert load_config("smoke").preset == "smoke"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 2**64}, f"seed must be an integer in [0, 2**64), got {2**64}"),  # built in Python
        ({"out_dir": ""}, "out_dir must name a folder, got ''"),  # '' put the runs in the working folder
        ({"out_dir": "  "}, "out_dir must name a folder, got '  '"),
    ],
)
def test_a_config_built_in_python_refuses_a_seed_torch_cannot_take_and_an_empty_out_dir(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataclasses.replace(TrainConfig(), **change)


@pytest.mark.parametrize("preset", ["seq2seq-reverse", "lm-shakespeare"])
@pytest.mark.parametrize("override", ["data.shift=2", "data.canvas=40"])
def test_image_placement_is_refused_for_models_of_other_tasks(preset, override):
    """A misplaced image override on a sequence task trained as if it were not set."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: only image models take it"):
        load_config(preset, [override])
    load_config("smoke", [override])  # an image model takes both


@pytest.mark.parametrize(
    ("preset", "override", "message"),
    [
        (None, "data.options=[1,2]", "data.options: expected dict, got [1, 2]"),
        (None, "data.options=null", "data.options: expected dict, got None"),
        ("capsnet-mnist", "model.router_options=[1]", "model.router_options: expected dict, got [1]"),
        ("main", "model.router_options=null", "model.router_options: expected dict, got None"),
        ("smoke", "model.channels.x=5", "model.channels: expected comma-separated ints"),
    ],
)
def test_a_list_or_null_where_a_mapping_goes_is_named(preset, override, message):
    """OmegaConf's TypeError ('Cannot merge incompatible container types') and a StopIteration of
    the search for the failing field reached the user as tracebacks."""
    with pytest.raises(ConfigError) as error:
        load_config(preset, [override])
    assert message in str(error.value)


def test_a_shipped_preset_is_not_shadowed_by_a_file_of_its_name(tmp_path, monkeypatch):
    """`torchvote main` in a folder holding a file 'main' read that file (a C source: 'unknown key
    int main()'; a YAML file trained the defaults under the preset's name)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "main").write_text("int main() { return 0; }\n")
    (tmp_path / "smoke").write_text("description: my notes\n")
    assert load_config("main") == load_config(str(_shipped("main")))
    assert load_config("smoke").model == load_config(str(_shipped("smoke"))).model
    assert load_config("./smoke").description == "my notes"  # the file, named as a path
    (tmp_path / "mine").write_text("description: mine\n")  # no preset of that name: the file
    assert load_config("mine").description == "mine"


def _shipped(name: str):
    import importlib.resources

    return importlib.resources.files("torchvote.presets") / f"{name}.yaml"


def test_preset_is_not_an_override():
    """preset=mnist-cnn trained smoke under the name mnist-cnn (run folder, config.yaml, and a
    resume check that then took `torchvote train mnist-cnn --resume` for it)."""
    with pytest.raises(ConfigError, match="'preset=mnist-cnn': preset is not an override"):
        load_config("smoke", ["preset=mnist-cnn"])


def test_a_saved_config_that_repeats_an_eval_on_key_still_loads_as_it_ran():
    """A run saved before repeated keys were refused trained with the last value; its config
    must still load (to resume, to evaluate), with a warning, while a new config refuses it."""
    from torchvote.training.config import config_to_dict, saved_config

    values = config_to_dict(load_config("smoke"))
    values["eval_on"] = ["mnist", "affnist-style:canvas=28,seed=3,ranges={shear: [0, 0]},seed=4"]
    with pytest.raises(ConfigError, match="seed is given twice"):
        config_from_dict(values)
    with pytest.warns(UserWarning, match="eval_on gives a key twice"):
        config = saved_config(values)
    assert config.eval_on == ("mnist", "affnist-style:canvas=28,ranges={shear: [0, 0]},seed=4")
    values["eval_on"] = ["mnist"]
    assert saved_config(values) == config_from_dict(values)  # nothing to drop: no warning


def test_eval_split_is_checked_against_the_evaluated_data_set():
    """data.eval_split was checked against data.name's splits, not data.eval_name's (mutation review):
    shakespeare has (train, val), mnist (train, test)."""
    config = load_config(None, ["data.name=mnist", "data.eval_name=shakespeare", "data.eval_split=val"])
    assert (config.data.eval_name, config.data.eval_split) == ("shakespeare", "val")
    with pytest.raises(ConfigError, match="'test' is not a split of 'shakespeare'; splits: train, val"):
        load_config(None, ["data.name=mnist", "data.eval_name=shakespeare", "data.eval_split=test"])
