"""The shared argument checks: accepted values pass through, the rest name the argument."""

import math

import pytest
import torch

from conftest import needs_one_graph_torch
from torchvote.validation import (
    autocast_enabled,
    check_choice,
    check_dim,
    check_float_dtype,
    check_float_tensor,
    check_in_range,
    check_input_dtype,
    check_positive_float,
    check_positive_int,
    check_probability,
    check_seed,
    is_integer,
)


@pytest.mark.parametrize("value", [1, 7])
def test_positive_int_accepts(value):
    assert check_positive_int(value, "n") == value


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "3", None])
def test_positive_int_rejects_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"iterations must be a positive integer, got"):
        check_positive_int(value, "iterations")


@pytest.mark.parametrize("value", [0, 7, 2**64 - 1])
def test_seed_accepts_what_torch_manual_seed_takes(value):
    assert check_seed(value) == value
    torch.Generator().manual_seed(value)  # the range is torch's own


def test_seed_takes_a_numpy_integer_as_its_value():
    import numpy as np

    seed = check_seed(np.uint64(5))
    assert seed == 5 and type(seed) is int


@pytest.mark.parametrize("value", [-1, 2**64])
def test_seed_out_of_range_names_the_range(value):
    with pytest.raises(ValueError, match=r"--seed must be an integer in \[0, 2\*\*64\), got") as raised:
        check_seed(value, "--seed")
    assert not isinstance(raised.value, TypeError)


def _check_top_k(top_k):
    from torchvote.models.sampling import check_sampling

    return check_sampling(1.0, top_k, None, None)


def _cross_entropy_ignoring(ignore_index):
    from torchvote.losses import cross_entropy

    return cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), ignore_index=ignore_index)


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (lambda v: check_positive_int(v, "num_heads"), 2.0),
        (lambda v: check_positive_int(v, "num_heads"), True),
        (lambda v: check_positive_int(v, "num_heads"), "2"),
        (lambda v: check_positive_float(v, "eps"), "1e-5"),
        (lambda v: check_seed(v), 1.0),
        (lambda v: check_seed(v), True),
        (lambda v: check_probability(v, "dropout"), "0.1"),
        (lambda v: check_in_range(v, "bandwidth", 0.0), None),
        (lambda v: check_dim(v, 2), True),  # squash(dim=True), squash(dim=1.0): a ValueError only
        (lambda v: check_dim(v, 2), 1.0),
        (lambda v: _check_top_k(v), 2.0),  # generate(top_k=2.0): a ValueError only
        (lambda v: _cross_entropy_ignoring(v), True),  # torch's TypeError from inside F.cross_entropy
        (lambda v: _cross_entropy_ignoring(v), "pad"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_type_error_and_a_value_error(check, value):
    """``num_heads=2.0`` was a ValueError where a wrong ``dtype`` or flag was a TypeError; a wrong
    type is now both (callers that caught ValueError still do)."""
    from torchvote.validation import ArgumentTypeError

    with pytest.raises(ArgumentTypeError) as raised:
        check(value)
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (lambda v: check_positive_int(v, "n"), 0),
        (lambda v: check_positive_float(v, "eps"), math.nan),
        (lambda v: check_probability(v, "dropout"), 1.5),
        (lambda v: check_in_range(v, "bandwidth", 0.0), -1.0),
        (lambda v: check_dim(v, 2), 2),
        (lambda v: _check_top_k(v), 0),
    ],
)
def test_a_number_out_of_range_is_only_a_value_error(check, value):
    with pytest.raises(ValueError) as raised:
        check(value)
    assert not isinstance(raised.value, TypeError)


def test_public_constructors_report_a_wrong_type_as_a_type_error():
    from torchvote.nn import CapsuleLinear, MultiHeadAttention

    with pytest.raises(TypeError, match="num_heads"):
        MultiHeadAttention(8, 2.0)
    with pytest.raises(TypeError, match="dropout"):
        MultiHeadAttention(8, 2, dropout="0.1")
    with pytest.raises(TypeError, match="iterations"):
        CapsuleLinear(4, 8, 3, 16, iterations=2.5)
    from torchvote.models import create_model

    with pytest.raises(TypeError, match="router_options=.* do not fit router='slot'"):  # a config's too
        create_model("capsnet", "tiny", router="slot", router_options={"hidden_dim": 2.0})


def test_positive_int_minimum():
    assert check_positive_int(0, "padding", minimum=0) == 0
    with pytest.raises(ValueError, match=r"padding must be an integer >= 0, got -1"):
        check_positive_int(-1, "padding", minimum=0)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "1"])
def test_positive_float_rejects(value):
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        check_positive_float(value, "eps")


def test_probability():
    assert check_probability(0, "dropout") == 0.0
    assert check_probability(0.5, "dropout") == 0.5
    for bad in (1.0, -0.1, math.nan, True):
        with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
            check_probability(bad, "dropout")


def test_choice_lists_the_choices():
    assert check_choice("sum", ("sum", "mean"), "aggregation") == "sum"
    with pytest.raises(ValueError, match=r"aggregation must be one of 'sum', 'mean', got 'max'"):
        check_choice("max", ("sum", "mean"), "aggregation")


@pytest.mark.parametrize("choices", ["abc", b"abc"])
def test_choice_refuses_a_string_of_choices(choices):
    # "a" in "abc" is a substring match, not a choice: the string is refused outright
    with pytest.raises(TypeError, match=r"choices: expected a collection of allowed values"):
        check_choice("a", choices, "mode")
    with pytest.raises(TypeError, match=r"choices: expected a collection"):
        check_choice("", choices, "mode")


def test_integer_tensor_refuses_floats_bools_and_non_tensors():
    import torch

    from torchvote.validation import check_integer_tensor

    check_integer_tensor(torch.tensor([1, 2]), "ids", "integer ids")
    check_integer_tensor(torch.tensor([1], dtype=torch.uint8), "ids", "integer ids")
    for value, described in ((torch.tensor([1.0]), "torch.float32"), (torch.tensor([True]), "torch.bool"),
                             ([1, 2], "list")):
        with pytest.raises(TypeError, match=f"ids must be integer ids, got {described}"):
            check_integer_tensor(value, "ids", "integer ids")


def test_in_range_names_the_interval():
    from torchvote.validation import check_in_range

    assert check_in_range(1, "p", 0.0, 1.0) == 1.0
    for value in (1.5, math.nan, math.inf, True, "0.5"):
        with pytest.raises(ValueError, match=r"p must be a finite number in \[0.0, 1.0\)"):
            check_in_range(value, "p", 0.0, 1.0, include_high=False)


def test_in_range_with_an_open_side_refuses_infinities_and_returns_a_float():
    """Infinity passes a bound left open (``low`` or ``high`` infinite) but is no finite number;
    NumPy scalars and ints come back as Python floats, as the docstring says (mutation review)."""
    import numpy as np

    from torchvote.validation import check_in_range

    cases = ((math.inf, {}, r"\(-inf, inf\)"), (-math.inf, {"high": 1.0}, r"\(-inf, 1.0\]"),
             (math.inf, {"low": 0.0}, r"\[0.0, inf\)"))
    for value, bounds, interval in cases:
        with pytest.raises(ValueError, match=f"x must be a finite number in {interval}, got"):
            check_in_range(value, "x", **bounds)
    with pytest.raises(ValueError, match=r"x must be a finite number in \(-inf, 1.0\], got 2"):
        check_in_range(2, "x", high=1.0)
    for value in (np.float32(0.5), np.int64(1), 1):
        checked = check_in_range(value, "x", 0.0, 1.0)
        assert type(checked) is float and checked == float(value)


def test_tensor_values_are_refused_at_once_on_the_cpu_with_the_detail():
    import torch

    from torchvote.validation import check_tensor_values

    ids = torch.tensor([3, -1, 4])
    check_tensor_values((ids >= -1).all(), "ids must be >= -1")  # fine: nothing raised
    with pytest.raises(ValueError, match=r"^ids must be >= 0: got \[3, -1, 4\]$"):
        check_tensor_values((ids >= 0).all(), "ids must be >= 0", detail=lambda: f": got {ids.tolist()}")


def test_tensor_values_off_the_cpu_are_asserted_on_the_device_and_never_read():
    """A meta tensor has no values: any read of one raises, so passing means nothing was read
    (on a GPU, nothing made the host wait); the detail, which would read, is never called."""
    import torch

    from torchvote.validation import check_tensor_values

    ids = torch.tensor([3, -1, 4], device="meta")
    with pytest.raises(RuntimeError):
        bool((ids >= 0).all())  # the read a check must not make
    check_tensor_values((ids >= 0).all(), "ids must be >= 0", detail=lambda: pytest.fail("read"))


@needs_one_graph_torch
def test_tensor_values_under_torch_compile_fail_with_the_message_in_one_graph():
    import torch

    from torchvote.validation import check_tensor_values

    def double(ids):
        check_tensor_values((ids >= 0).all(), "ids must be >= 0")
        return ids * 2

    compiled = torch.compile(double, fullgraph=True)  # a read of the flag would break the graph
    assert compiled(torch.tensor([1, 2])).tolist() == [2, 4]
    with pytest.raises(RuntimeError, match="ids must be >= 0"):
        compiled(torch.tensor([1, -2]))


def test_broadcast_shape_follows_torch_broadcast_shapes():
    import torch
    from hypothesis import given
    from hypothesis import strategies as st

    from torchvote.validation import broadcast_shape

    shape = st.lists(st.integers(0, 3), max_size=4).map(tuple)

    @given(st.lists(shape, min_size=1, max_size=3))
    def agrees(shapes):
        try:
            expected = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            expected = None
        assert broadcast_shape(*shapes) == expected

    agrees()


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_check_float_dtype_takes_none_and_floating_dtypes(dtype):
    assert check_float_dtype(dtype) is dtype


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32", float, torch.complex64])
def test_check_float_dtype_refuses_the_rest_by_name(dtype):
    with pytest.raises(TypeError, match=r"table_dtype must be a floating-point torch.dtype or None, got"):
        check_float_dtype(dtype, "table_dtype")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_check_float_tensor_takes_floating_tensors_on_any_device(dtype):
    check_float_tensor(torch.zeros(2, dtype=dtype), "weight")
    check_float_tensor(torch.zeros(2, dtype=dtype, device="meta"), "weight")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([[1.0]], "weight must be a floating-point tensor, got list"),
        (None, "weight must be a floating-point tensor, got NoneType"),
        (torch.ones(2, dtype=torch.int64), "weight must be floating point, got dtype torch.int64"),
        (torch.ones(2, dtype=torch.bool), "weight must be floating point, got dtype torch.bool"),
        (torch.ones(2, dtype=torch.complex64), "weight must be floating point, got dtype torch.complex64"),
    ],
)
def test_check_float_tensor_refuses_the_rest_by_name(value, match):
    with pytest.raises(TypeError, match=match):
        check_float_tensor(value, "weight")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_input_dtype_mismatch_is_a_type_error_on_any_device(device):
    """On "meta" the autocast query itself raised a RuntimeError, hiding the argument's name."""
    votes = torch.zeros(2, 3, dtype=torch.float64, device=device)
    with pytest.raises(TypeError, match=r"votes has dtype torch.float64 but the module's parameters are "):
        check_input_dtype(votes, torch.float32, "votes")
    check_input_dtype(votes, torch.float64, "votes")  # the same dtype passes


def test_input_dtype_mismatch_passes_under_autocast():
    votes = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert not autocast_enabled("cpu") and not autocast_enabled("meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_enabled("cpu")
        check_input_dtype(votes, torch.float32, "votes")
    with pytest.raises(TypeError, match="votes has dtype torch.bfloat16"):
        check_input_dtype(votes, torch.float32, "votes")


def test_numpy_scalars_are_numbers() -> None:
    """A size or rate read from a NumPy array (np.int64(16), np.float32(0.1)) is a number, taken as
    its Python value; NumPy's bool is not, as Python's is not."""
    import numpy as np

    from torchvote.nn import MultiHeadAttention

    assert check_positive_int(np.int64(16), "embed_dim") == 16
    assert type(check_positive_int(np.int32(3), "n")) is int
    assert check_positive_float(np.float32(0.5), "eps") == 0.5
    assert check_probability(np.float32(0.25), "dropout") == 0.25
    for bad in (np.bool_(True), np.float64(2.0), np.int64(0)):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            check_positive_int(bad, "n")
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        check_probability(np.bool_(False), "dropout")
    layer = MultiHeadAttention(np.int64(16), np.int64(2), dropout=np.float32(0.1))
    x = torch.randn(2, 3, 16)
    assert layer(x, x, x)[0].shape == (2, 3, 16)


def test_numpy_integers_are_taken_where_an_integer_argument_is_checked_by_hand() -> None:
    """About a dozen arguments were checked with ``isinstance(x, int)``, which refuses np.int64(2)
    (an index or count read from an array) that check_positive_int takes."""
    import numpy as np

    from torchvote.data.mnist import _validate_limit
    from torchvote.data.text import sample_char_batch
    from torchvote.data.transforms import random_shift
    from torchvote.explain.sentences import check_iterations, check_layer
    from torchvote.explain.statistics import perturbation_poses
    from torchvote.models import create_model
    from torchvote.models.transformer_backbone import check_max_new_tokens
    from torchvote.nn import SinusoidalPositionalEncoding

    two = np.int64(2)
    assert not is_integer(np.bool_(True)) and not is_integer(2.0) and is_integer(two)
    encoding = SinusoidalPositionalEncoding(4, max_len=8)
    inputs = torch.zeros(1, 3, 4)
    torch.testing.assert_close(encoding(inputs, offset=two), encoding(inputs, offset=2))
    assert perturbation_poses(torch.ones(16), steps=np.int64(3)).shape == (16, 3, 16)
    assert check_iterations([two, np.int32(3)], "--iterations") == [2, 3]
    assert check_layer(np.int64(-1), 6, "--layer") == 5
    assert check_max_new_tokens(two, 10) == 2
    assert _validate_limit(np.int64(5)) == 5 and type(_validate_limit(np.int64(5))) is int
    assert random_shift(torch.ones(2, 1, 5, 5), max_shift=two).shape == (2, 1, 5, 5)
    batch = sample_char_batch(torch.arange(20), two, np.int64(3), generator=torch.Generator().manual_seed(0))
    assert batch[0].shape == (3, 2)
    torch.manual_seed(0)
    model = create_model("transformer-lm", "tiny").eval()
    assert model.generate(torch.tensor([[1, 2]]), 2, top_k=two).shape == (1, 4)


def test_device_exists_checks_cuda_against_this_machine(monkeypatch):
    from torchvote.validation import check_device_exists

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cpu", "meta"):
        assert check_device_exists(torch.device(device)) == torch.device(device)
    # no syntax suggested: `torchvote evaluate ... device=cpu`, as it said, is no evaluate argument
    with pytest.raises(ValueError, match=r"device 'cuda' requested but CUDA is not available; use the CPU "
                                         r"\('cpu'\) or 'auto'$"):
        check_device_exists(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device_exists(torch.device("cuda:1")) == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"'cuda:2' requested but this machine has 2 CUDA device\(s\)"):
        check_device_exists(torch.device("cuda:2"))


def test_factory_device_reads_what_torch_reads_and_names_the_rest(monkeypatch):
    from torchvote.models import create_model
    from torchvote.validation import check_factory_device

    assert check_factory_device(None) is None
    assert check_factory_device("meta") == torch.device("meta") == check_factory_device(torch.device("meta"))
    expected = r"device must be a torch.device or its name \('cpu', 'cuda:0', 'meta'\), got "
    for bad, error in (("gpu", ValueError), ("cuda:-1", ValueError), (3.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match=expected + repr(bad)):
            check_factory_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="(CUDA is not available|and this machine has none)"):
        check_factory_device(0)  # an accelerator's index, as torch reads it
    # create_model's device failed inside the first layer: torch's "Expected one of cpu, cuda, ..."
    with pytest.raises(ValueError, match=expected + "'gpu'"):
        create_model("cnn-baseline", "tiny", device="gpu")
    assert next(create_model("cnn-baseline", "tiny", device="meta").parameters()).is_meta


def _path_takers():
    """Each public function or class taking a path, called with ``value`` as that path."""
    import matplotlib

    matplotlib.use("Agg")
    from torchvote.demo import run_demo
    from torchvote.experiments.report import read_result
    from torchvote.explain.figures import save_figure
    from torchvote.explain.metric_plots import metric_curves
    from torchvote.explain.record import load_record
    from torchvote.explain.report import HtmlReport
    from torchvote.training.checkpoint import (
        find_checkpoint,
        load_model_weights,
        load_training_state,
        read_model_metadata,
        save_checkpoint,
    )
    from torchvote.training.metrics import MetricsWriter, read_metrics
    from torchvote.training.plots import plot_training_curves
    from torchvote.training.results import find_resumable_checkpoint, load_run_config

    def figure():
        from matplotlib.figure import Figure

        return Figure()

    return {
        "location": [find_checkpoint, find_resumable_checkpoint],
        "run_dir": [MetricsWriter, load_run_config],
        "metrics_path": [lambda v: plot_training_curves(v, "curves.png")],
        "path": [
            read_model_metadata,
            load_training_state,
            lambda v: load_model_weights(torch.nn.Linear(2, 2), v),
            read_metrics,
            metric_curves,
            load_record,
            read_result,
        ],
        "directory": [
            lambda v: save_checkpoint(v, step=1, model=torch.nn.Linear(2, 2), model_metadata={}, state={})
        ],
        "out_path": [lambda v: plot_training_curves("metrics.jsonl", v)],
        "stem": [lambda v: save_figure(figure(), v)],
        "out_dir": [lambda v: HtmlReport("title", v)],
        "output_dir": [lambda v: run_demo(output_dir=v)],
    }


@pytest.mark.parametrize("value", [None, 5, b"runs/x"])
def test_a_path_argument_given_no_path_names_the_argument(value):
    """pathlib's "expected str, bytes or os.PathLike object, not NoneType" named no argument."""
    for argument, calls in _path_takers().items():
        for call in calls:
            with pytest.raises(TypeError, match=rf"^{argument}: expected a path \(str or os.PathLike\)"):
                call(value)


def test_a_path_argument_given_the_empty_string_is_refused():
    """'' is pathlib's '.': the working folder read, or written into, as if it had been named."""
    for argument, calls in _path_takers().items():
        for call in calls:
            with pytest.raises(ValueError, match=rf"^{argument}: expected a path, got an empty string"):
                call("")


def test_as_path_expands_the_home_folder(monkeypatch, tmp_path):
    """A '~/runs' path was taken literally, a folder named '~' in the working one (mutation review)."""
    from pathlib import Path

    from torchvote.validation import as_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert as_path("~/runs", "run_dir") == tmp_path / "runs"
    assert as_path(Path("~") / "x", "run_dir") == tmp_path / "x"


@pytest.mark.parametrize(
    ("value", "include_low", "include_high", "accepted"),
    [
        (0.0, True, True, True),
        (0.0, False, True, False),
        (1.0, True, True, True),
        (1.0, True, False, False),
        (0.5, False, False, True),
    ],
)
def test_in_range_includes_or_excludes_each_bound_as_told(value, include_low, include_high, accepted):
    """A value equal to a bound is taken only where that bound is included (mutation review)."""
    bounds = {"include_low": include_low, "include_high": include_high}
    if accepted:
        assert check_in_range(value, "p", 0.0, 1.0, **bounds) == value
    else:
        with pytest.raises(ValueError, match="p must be a finite number in"):
            check_in_range(value, "p", 0.0, 1.0, **bounds)


def test_check_dim_of_a_0d_tensor_takes_0_and_minus_1_only():
    """torch's reductions read a 0-D tensor as one entry: dim 0 and -1, nothing else (mutation review)."""
    assert check_dim(0, 0) == 0 and check_dim(-1, 0) == -1
    for dim in (1, -2):
        with pytest.raises(ValueError, match=r"dim must be an axis of the 0-D input, in \[-1, 1\)"):
            check_dim(dim, 0)


def test_index_range_refuses_the_size_itself_and_takes_the_last_index():
    """[0, size) is open above: an index equal to the size is out of range (mutation review)."""
    from torchvote.validation import check_index_range

    check_index_range(torch.tensor([0, 4]), 5, "ids out of range")
    check_index_range(torch.tensor([], dtype=torch.long), 5, "ids out of range")
    for bad, extremes in (([0, 5], "smallest 0, largest 5"), ([-1, 2], "smallest -1, largest 2")):
        with pytest.raises(ValueError, match=f"ids out of range: {extremes}"):
            check_index_range(torch.tensor(bad), 5, "ids out of range")


def test_check_texts_refuses_one_string_and_takes_a_list():
    """One string would be read as its characters ("uniform" as seven filters) (mutation review)."""
    from torchvote.validation import check_texts

    assert check_texts(["uniform"], "filters") == ("uniform",)
    assert check_texts(("a", "b"), "filters") == ("a", "b")
    for value in ("uniform", b"uniform"):
        with pytest.raises(TypeError, match=r"filters must be a list of strings, got the single string"):
            check_texts(value, "filters")
    with pytest.raises(ValueError, match=r"filters must be a list of strings, got 3 in it"):
        check_texts(["a", 3], "filters")


def test_check_bool_fields_refuses_a_truthy_non_bool_in_a_bool_field():
    """The string "no" is truthy and would switch an option on (mutation review)."""
    import dataclasses

    from torchvote.validation import check_bool_fields

    for annotation in (bool, "bool"):  # the class, and the string `from __future__ import annotations` gives
        config_cls = dataclasses.make_dataclass("Config", [("name", str), ("flag", annotation)])
        check_bool_fields(config_cls(name="x", flag=False))
        check_bool_fields(config_cls(name=5, flag=True))  # only the bool fields are checked
        with pytest.raises(TypeError, match=r"flag must be True or False, got 'no'"):
            check_bool_fields(config_cls(name="x", flag="no"))
