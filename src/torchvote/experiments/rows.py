"""The experiments of docs/results.md, one :class:`Row` each, as data.

A row is a set of training runs (its :class:`Variant`\\ s, each a shipped preset plus ``key=value``
overrides) repeated over seeds, and the numbers read from their final evaluations
(:class:`Metric`). Each row has two budgets: ``cpu`` (sizes that finish on a laptop CPU in
minutes, the figures measured for docs/results.md where no GPU was lent) and ``paper`` (the
papers' sizes and schedules, meant for a GPU). ``torchvote reproduce NAME`` runs a row
(:mod:`torchvote.experiments.runner`); ``torchvote reproduce --list`` lists them.

Papers quoted in the rows:

* Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules": Table 1 (MNIST test error
  of CapsNet with 1 or 3 routing iterations, with and without the reconstruction loss), sec. 5.2
  (affNIST: 79% for CapsNet against 66% for the CNN, both at 99.2x% on expanded MNIST), sec. 6
  (MultiMNIST: 5.2% error).
* Mazzia, Salvetti & Chiaberge 2021, "Efficient-CapsNet": 0.26% MNIST test error (single model).
* Hinton, Sabour & Frosst 2018, "Matrix capsules with EM routing": EM routing with 1-3 iterations.
* Paik, Kwon & Kim 2019, "Capsule Networks Need an Improved Routing Algorithm", and Gu & Tresp
  2020, "Improving the Robustness of Capsule Networks to Image Affine Transformations": uniform
  routing does as well as the routing procedures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from torchvote.validation import check_choice, check_positive_int, check_texts

__all__ = ["BUDGETS", "Metric", "Row", "Variant", "get_row", "list_rows"]

#: The budgets every row defines.
BUDGETS: tuple[str, ...] = ("cpu", "paper")

Transform = Literal["error_percent", "percent", "bits", "value"]


@dataclass(frozen=True)
class Metric:
    """One number read from a run's final evaluation.

    Args:
        label: column heading (``"MNIST test error (%)"``).
        key: the metric of the evaluation (``"accuracy"``, ``"loss"``, ``"sequence_accuracy"``).
        dataset: the evaluation it comes from, as the run names it (``"affnist-style/test"``);
            ``None``: the run's main evaluation (its training set's test split).
        transform: ``error_percent`` (100 x (1 - value)), ``percent`` (100 x value), ``bits``
            (a loss in nats per token divided by ln 2: bits per character) or ``value``.
    """

    label: str
    key: str = "accuracy"
    dataset: str | None = None
    transform: Transform = "error_percent"

    def __post_init__(self) -> None:
        check_choice(self.transform, get_args(Transform), "transform")  # a typo read the raw value


@dataclass(frozen=True)
class Variant:
    """One configuration of a row, run once per seed.

    Args:
        label: its name in the table, also its folder (made file-safe).
        preset: a shipped preset (``torchvote list presets``).
        overrides: ``key=value`` overrides of the preset, as on the ``torchvote train`` line.
        paper: the paper's figure for this configuration, as text (``"0.25 +/- 0.005"``), or
            ``None``.
    """

    label: str
    preset: str
    overrides: tuple[str, ...] = ()
    paper: str | None = None

    def __post_init__(self) -> None:  # one string would be read as one override per character
        object.__setattr__(self, "overrides", check_texts(self.overrides, "overrides"))


@dataclass(frozen=True)
class Row:
    """One experiment of docs/results.md.

    Args:
        name: what ``torchvote reproduce NAME`` takes.
        letter: its letter in the issue and in docs/results.md.
        title: one line.
        variants: the configurations compared.
        metrics: the columns.
        budgets: ``{"cpu": overrides, "paper": overrides}`` added after every variant's own.
        seeds: how many seeds by default (0, 1, ...).
        measure: for a row that trains nothing, ``measure(budget) -> list of table rows``
            (dicts of column -> value) instead of variants.
        note: what the reader should know (differences from the paper, what needs a GPU).
    """

    name: str
    letter: str
    title: str
    variants: tuple[Variant, ...] = ()
    metrics: tuple[Metric, ...] = ()
    budgets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    seeds: int = 3
    measure: Callable[..., list[dict[str, Any]]] | None = None
    note: str = ""

    def __post_init__(self) -> None:
        check_positive_int(self.seeds, "seeds")

    def overrides(self, variant: Variant, budget: str, seed: int) -> list[str]:
        """The ``torchvote train`` overrides of one run: the variant's, the budget's, the seed."""
        if budget not in self.budgets:
            raise ValueError(f"budget: expected one of {sorted(self.budgets)}, got {budget!r}")
        return [*variant.overrides, *self.budgets[budget], f"seed={seed}"]


_MNIST_ERROR = Metric("MNIST test error (%)")
_NO_LOGS = ("progress=false", "tensorboard=false")
#: Evaluate once, at the end (the runs read only the final evaluation).
_QUIET = (*_NO_LOGS, "eval_every=0")
#: The main job's schedule: one-cycle at twice the paper's rate, which converges in few steps,
#: rising over its first 30% (a preset's warm-up, e.g. mnist-cnn's 50 steps, is not kept).
_FAST = ("optim.lr=0.002", "optim.schedule=onecycle", "optim.warmup_steps=0")
#: The CPU budget of the small CapsNet on MNIST (rows a and f share it: row a's "3 iterations,
#: with reconstruction" and row f's "dynamic / MNIST" are the same runs).
_CAPSNET_CPU = ("data.limit=20000", "epochs=1", *_FAST, *_NO_LOGS)


def _capsnet_routing() -> Row:
    variants = []
    paper = {(1, False): "0.34 +/- 0.032", (1, True): "0.29 +/- 0.011", (3, False): "0.35 +/- 0.036"}
    paper[(3, True)] = "0.25 +/- 0.005"
    for iterations in (1, 3):
        for reconstruction in (False, True):
            weight = "0.0005" if reconstruction else "0"
            variants.append(
                Variant(
                    f"{iterations} iteration{'s' if iterations > 1 else ''}, "
                    f"{'with' if reconstruction else 'no'} reconstruction",
                    "capsnet-mnist",
                    (f"model.iterations={iterations}", f"loss.reconstruction_weight={weight}"),
                    paper=paper[(iterations, reconstruction)],
                )
            )
    return Row(
        "capsnet-routing",
        "a",
        "CapsNet MNIST test error: 1 vs 3 routing iterations, with and without reconstruction",
        tuple(variants),
        (_MNIST_ERROR,),
        {
            "cpu": _CAPSNET_CPU,
            "paper": ("model.preset=paper", "epochs=50", *_NO_LOGS),
        },
        note="Paper: Sabour et al. 2017, Table 1 (paper-size CapsNet, 2-pixel shifts, trained to the end).",
    )


def _real_affnist_present() -> bool:
    from torchvote.data.affnist import find_affnist
    from torchvote.data.errors import DataNotFoundError

    try:
        find_affnist()
    except DataNotFoundError:
        return False
    return True


def _affnist() -> Row:
    tests = "affnist-style,affnist" if _real_affnist_present() else "affnist-style"
    canvas = ("data.canvas=40", f"eval_on=[{tests}]")
    return Row(
        "affnist",
        "b",
        "affNIST: CapsNet vs the CNN baseline, trained on translated 40x40 MNIST",
        (
            Variant("CapsNet", "capsnet-mnist", canvas, paper="79% affNIST (99.23% expanded MNIST)"),
            Variant("CNN baseline", "mnist-cnn", canvas, paper="66% affNIST (99.22% expanded MNIST)"),
        ),
        (
            Metric("MNIST test (40x40) accuracy (%)", transform="percent"),
            Metric("affNIST-style accuracy (%)", dataset="affnist-style/test", transform="percent"),
            Metric("affNIST accuracy (%)", dataset="affnist/test", transform="percent"),
        ),
        {
            "cpu": ("epochs=1", *_FAST, *_QUIET),
            # the paper's protocol: each model trained until it reaches about 99.2% (at most 30 epochs)
            "paper": ("model.preset=paper", "epochs=30", "stop_at_accuracy=0.992", *_NO_LOGS),
        },
        note=(
            "Paper: Sabour et al. 2017, sec. 5.2, on the real affNIST; the affNIST column appears for "
            "runs made after `torchvote data affnist --download` has fetched it. The paper stops both "
            "models at about 99.2% on expanded MNIST, and so does the paper budget "
            "(`stop_at_accuracy=0.992`, checked after each epoch on the 40x40 MNIST test digits, at "
            "most 30 epochs); the CPU budget stops after a fixed number of epochs."
        ),
    )


def _multimnist() -> Row:
    return Row(
        "multimnist",
        "c",
        "MultiMNIST: CapsNet on two overlapping digits",
        (Variant("CapsNet", "capsnet-multimnist", paper="5.2% error"),),
        (Metric("MultiMNIST test error (%)"),),
        {
            "cpu": ("data.limit=15000", "epochs=1", "data.eval_limit=5000", *_FAST, *_QUIET),
            "paper": ("model.preset=paper", "epochs=1000", *_NO_LOGS),
        },
        note=(
            "Paper: Sabour et al. 2017, sec. 6 (60M training pairs generated on the fly; an image "
            "counts as right when the two longest capsules are its two digits). Here the pairs are "
            "drawn afresh every epoch (60k per epoch: the paper's 60M pairs are 1,000 epochs); the CPU "
            "budget sees 15,000 pairs once and scores the first 5,000 of the fixed test pairs."
        ),
    )


def _efficient_capsnet() -> Row:
    return Row(
        "efficient-capsnet",
        "d",
        "Efficient-CapsNet on MNIST",
        (Variant("Efficient-CapsNet (self-attention routing)", "efficient-capsnet-mnist", paper="0.26"),),
        (_MNIST_ERROR,),
        {
            "cpu": ("data.limit=20000", "epochs=1", *_QUIET),
            # the paper's 100 epochs with the authors' batch norm and he_normal kernels
            "paper": ("epochs=100", "model.preset=authors", *_NO_LOGS),
        },
        note="Paper: Mazzia et al. 2021, Table 2 (single model, 0.26% error; ensembles reach 0.16%).",
    )


def _iterations(count: int) -> str:
    return f"{count} iteration{'s' if count > 1 else ''}"


#: Rows e: MNIST test error and the affNIST-style set at the model's 28x28 canvas.
_EM_METRICS = (
    _MNIST_ERROR,
    Metric("affNIST-style (28x28) accuracy (%)", dataset="affnist-style/test", transform="percent"),
)


def _em_iterations() -> Row:
    from torchvote.functional.em import default_inverse_temperature

    # The authors' inverse temperature at the last of 3 EM iterations: 0.01 (1 - 0.95^3) = 0.00142625.
    lambda_3 = f"{default_inverse_temperature(2):.8g}"
    return Row(
        "em-iterations",
        "e",
        "EM matrix capsules on MNIST and affNIST-style with 1, 2 and 3 routing iterations",
        (
            *(
                Variant(_iterations(r), "em-capsnet-mnist", (f"model.iterations={r}",))
                for r in (1, 2, 3)
            ),
            # The authors' lambda schedule ends lower with fewer iterations (0.0005 after one);
            # these hold the last pass at the 3-iteration value, so only the passes differ.
            *(
                Variant(
                    f"{_iterations(r)}, last lambda held at 0.00143",
                    "em-capsnet-mnist",
                    (f"model.iterations={r}", f"model.final_inverse_temperature={lambda_3}"),
                )
                for r in (1, 2)
            ),
        ),
        _EM_METRICS,
        {
            "cpu": (
                "data.limit=10000",
                "epochs=1",
                "data.eval_limit=1000",
                "eval_on=[affnist-style:canvas=28]",
                *_QUIET,
            ),
            "paper": ("epochs=30", "eval_on=[affnist-style:canvas=28]", *_NO_LOGS),
        },
        note=(
            "Hinton et al. 2018 report smallNORB (1.8% error) and affNIST after smallNORB-style training, "
            "not this MNIST set-up: no paper figure to compare with."
        ),
    )


def _em_iterations_longer() -> Row:
    return Row(
        "em-iterations-longer",
        "e",
        "EM matrix capsules: 2 vs 3 routing iterations over longer training (test error every epoch)",
        tuple(Variant(_iterations(r), "em-capsnet-mnist", (f"model.iterations={r}",)) for r in (2, 3)),
        _EM_METRICS,
        {
            # Row e's runs, three times as long; the per-epoch errors are the runs' eval records.
            "cpu": (
                "data.limit=10000",
                "epochs=3",
                "data.eval_limit=1000",
                "eval_on=[affnist-style:canvas=28]",
                *_NO_LOGS,
                "eval_every=1",
            ),
            "paper": ("epochs=30", "eval_on=[affnist-style:canvas=28]", *_NO_LOGS, "eval_every=1"),
        },
        note=(
            "Does the third iteration catch up with row e's second given more steps? The error after "
            "each epoch is in each run's metrics.jsonl (event eval)."
        ),
    )


_ROUTERS = ("dynamic", "em", "inverted_dot_product", "self_attention", "slot", "uniform")
_ROUTER_DATA = {
    "MNIST": ("capsnet-mnist", ()),
    "affNIST-style": ("capsnet-mnist", ("data.canvas=40", "eval_on=[affnist-style]")),
    "MultiMNIST": ("capsnet-multimnist", ()),
}


#: The data sets of one label per image, where row f's controls run: ``em`` trains with the spread
#: loss there (``loss.name=auto``), and the linear-scores controls with cross-entropy, both of
#: which take one label per image. The MultiMNIST preset names the margin loss, so ``em`` trains
#: with the margin loss there, as every other router does.
_SINGLE_LABEL_DATA = ("MNIST", "affNIST-style")


def _router_swap() -> Row:
    variants: list[Variant] = []
    for data, (preset, options) in _ROUTER_DATA.items():
        for router in _ROUTERS:
            variants.append(Variant(f"{router} / {data}", preset, (f"model.router={router}", *options)))
        if data in _SINGLE_LABEL_DATA:  # the controls: EM's router against its loss, readouts
            spread = ("model.router=dynamic", "loss.name=spread", *options)
            variants.append(Variant(f"dynamic, spread loss / {data}", preset, spread))
            margin = ("model.router=em", "loss.name=margin", *options)
            variants.append(Variant(f"em, margin loss / {data}", preset, margin))
            for router in ("dynamic", "inverted_dot_product"):  # Tsai et al. 2020's readout
                linear = (f"model.router={router}", "model.scores=linear", "model.decoder=false",
                          *options)
                variants.append(Variant(f"{router}, linear scores / {data}", preset, linear))
    return Row(
        "router-swap",
        "f",
        "Router swap: one CapsNet backbone, every router, on MNIST, affNIST-style and MultiMNIST",
        tuple(variants),
        (
            Metric("test error (%), own test set"),
            Metric("affNIST-style accuracy (%)", dataset="affnist-style/test", transform="percent"),
        ),
        {
            "cpu": _CAPSNET_CPU,
            "paper": ("epochs=30", *_NO_LOGS),
        },
        note=(
            "The small CapsNet (288 primary capsules on 28x28) with each router in place of dynamic "
            "routing. `em` trains with the spread loss on MNIST and affNIST-style (`loss.name=auto`) "
            "and with the margin loss on MultiMNIST (its preset's loss: the spread loss takes one "
            "label per image). Two controls tell EM's router from its loss: `dynamic, spread loss` "
            "(dynamic routing, the spread loss on its capsules' lengths, no reconstruction term, as "
            "EM's) and `em, margin loss` (EM routing, the margin loss on its activations plus the "
            "reconstruction term, as dynamic routing's). Two more score the class capsules as Tsai "
            "et al. 2020 do for inverted dot-product routing, by one linear map shared by every class "
            "capsule, trained with cross-entropy and no decoder (`model.scores=linear`): `"
            "inverted_dot_product, linear scores` and, beside it, `dynamic, linear scores`. Paik et "
            "al. 2019 and Gu & Tresp 2020 find uniform routing as good as the routing procedures."
        ),
    )


def _attention_variants(preset: str, *, receivers: bool) -> tuple[Variant, ...]:
    variants = [Variant("softmax attention", preset, ("model.attention=softmax",))]
    over = ("senders", "receivers") if receivers else ("senders",)
    for normalize_over in over:
        over_option = (
            () if normalize_over == "senders" else (f"model.routing_normalize_over={normalize_over}",)
        )
        for passes in (2, 3):
            variants.append(
                Variant(
                    f"routing, {passes} passes, over {normalize_over}",
                    preset,
                    ("model.attention=routing", f"model.routing_iterations={passes}", *over_option),
                )
            )
    return tuple(variants)


def _attention_swap_lm() -> Row:
    return Row(
        "attention-swap-lm",
        "g",
        "Attention swap, character LM on Shakespeare: softmax vs routing-style attention",
        _attention_variants("lm-shakespeare", receivers=False),
        (Metric("validation bits per character", key="loss", transform="bits"),),
        {
            "cpu": (
                "max_steps=400",
                "batch_size=32",
                "model.context_length=64",
                "model.dropout=0.0",
                "data.eval_limit=200000",
                *_QUIET,
            ),
            "paper": ("epochs=4", *_NO_LOGS),
        },
        note=(
            "Bits per character = the validation cross-entropy / ln 2 (the `bits_per_char` column of "
            "the tables that train and evaluate print, beside the loss in nats). "
            "Same model, parameters and steps for every variant (routing attention adds no parameter). "
            "A causal language model cannot normalise over the receivers: a later query would change "
            "an earlier output, so only `senders` is run."
        ),
    )


def _attention_swap_seq2seq() -> Row:
    return Row(
        "attention-swap-seq2seq",
        "g",
        "Attention swap, Transformer encoder-decoder reversing digit strings",
        _attention_variants("seq2seq-reverse", receivers=True),
        (
            Metric("exact match (%)", key="sequence_accuracy", transform="percent"),
            Metric("token accuracy (%)", transform="percent"),
        ),
        {
            "cpu": ("epochs=3", *_NO_LOGS),
            "paper": ("epochs=8", *_NO_LOGS),
        },
        note=(
            "Exact match = whole target right under teacher forcing, which equals greedy decoding's "
            "exact match (the `sequence_accuracy` column of the tables that train and "
            "evaluate print). With `receivers`, the encoder's self-attention normalises over the receivers; "
            "the decoder's attentions stay over the senders (a softmax over the target positions would "
            "let a later target token change an earlier prediction)."
        ),
    )


def _pretrained_routing() -> Row:
    def measure(budget: str) -> list[dict[str, Any]]:
        from torchvote.experiments.pretrained_routing import measure_routing_drift

        return measure_routing_drift(layers=range(6))

    return Row(
        "pretrained-routing",
        "h",
        "Pretrained MiniLM with one layer's attention run as r passes of voting, no retraining",
        budgets={"cpu": (), "paper": ()},
        seeds=1,
        measure=measure,
        note="Deterministic (no training, no seed): one run.",
    )


_BUILDERS: tuple[Callable[[], Row], ...] = (
    _capsnet_routing,
    _affnist,
    _multimnist,
    _efficient_capsnet,
    _em_iterations,
    _em_iterations_longer,
    _router_swap,
    _attention_swap_lm,
    _attention_swap_seq2seq,
    _pretrained_routing,
)


def list_rows() -> dict[str, Row]:
    """Every row, by name, in the order of docs/results.md."""
    rows = [build() for build in _BUILDERS]
    return {row.name: row for row in rows}


def get_row(name: str) -> Row:
    """The row called ``name``, or the one row with that letter (``"h"``).

    Args:
        name: a row's name (``torchvote reproduce --list``) or its letter.

    Returns:
        The row.

    Raises:
        ValueError: an unknown name, or a letter several rows share (the message lists them).
    """
    rows = list_rows()
    if name in rows:
        return rows[name]
    lettered = [row.name for row in rows.values() if row.letter == name]
    if len(lettered) == 1:
        return rows[lettered[0]]
    if lettered:
        raise ValueError(f"name: row {name!r} has several experiments; name one: {', '.join(lettered)}")
    raise ValueError(f"name: unknown experiment {name!r}; known: {', '.join(rows)} (or their letters)")
