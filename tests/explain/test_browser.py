"""The report in a real browser: headless Chromium, offline, every image decoded.

Uses the system Chromium (Debian's ``chromium``; ``.ci/install-browser.sh`` installs it) driven
by Playwright's Python package pointed at that executable; Playwright's own browser download
cannot work offline. Skips, saying why, only when no browser or driver can be found.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')

from torchvote.explain.attention_plots import attention_heatmap  # noqa: E402
from torchvote.explain.record import explain_record  # noqa: E402
from torchvote.explain.report import HtmlReport  # noqa: E402

from .offline import offline_problems, synthetic_record  # noqa: E402

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str:
    found = os.environ.get("TORCHVOTE_CHROMIUM") or next(filter(None, map(shutil.which, CANDIDATES)), None)
    if not found:
        pytest.skip(
            f"no Chromium found (looked for {', '.join(CANDIDATES)} and TORCHVOTE_CHROMIUM); "
            "run .ci/install-browser.sh"
        )
    return found


@pytest.fixture(scope="module")
def report_page(tmp_path_factory) -> Path:
    """A report with every capsule picture, an attention heatmap and, if installed, the real encoder."""
    out = tmp_path_factory.mktemp("browser-report")
    report = HtmlReport("torchvote explain (browser test)", out)
    report.heading("Attention")
    weights = torch.softmax(torch.randn(7, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    tokens = ["the", "train", "left", "the", "station", "on", "time"]
    report.figure(attention_heatmap(weights, tokens, title="random weights"), "heatmap", caption="heatmap")
    explain_record(synthetic_record(), report)
    try:
        from torchvote.explain.sentences import explain_sentences
        from torchvote.pretrained import load_pretrained

        model = load_pretrained()
    except ModuleNotFoundError:
        model = None  # the capsule pictures alone still exercise the page
    if model is not None:
        explain_sentences(
            ["Alice wrote a note and gave it to Bob"], out, model=model, iterations=(3,), report=report
        )
    return report.write()


def test_report_renders_offline_in_chromium(report_page, tmp_path):
    executable = _browser()
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="needs Playwright's Python package (pip install playwright; no browser download)",
    )
    assert offline_problems(report_page.read_text()) == []
    requests: list[str] = []
    with sync_api.sync_playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=executable, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1600})
            page.on("request", lambda request: requests.append(request.url))

            def route(handle):  # anything not local is refused, so nothing can leave the machine
                if handle.request.url.startswith(("file:", "data:")):
                    handle.continue_()
                else:
                    handle.abort()

            page.route("**/*", route)
            page.goto(report_page.resolve().as_uri(), wait_until="load")
            images = page.evaluate(
                "Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete,"
                " width: i.naturalWidth, height: i.naturalHeight}))"
            )
            svgs = page.evaluate(
                "Array.from(document.querySelectorAll('body > svg, figure svg')).map(s => {"
                " const r = s.getBoundingClientRect(); return [r.width, r.height]; })"
            )
            title = page.title()
            screenshot = tmp_path / "report-screenshot.png"
            page.screenshot(path=str(screenshot), full_page=False)
        finally:
            browser.close()
    assert title.startswith("torchvote explain")
    assert len(images) >= 8, images
    broken = [
        image["alt"]
        for image in images
        if not (image["complete"] and image["width"] > 0 and image["height"] > 0)
    ]
    assert broken == [], f"images that did not load: {broken}"
    assert all(width > 0 and height > 0 for width, height in svgs), svgs
    outside = [url for url in requests if not url.startswith(("file:", "data:"))]
    assert outside == [], f"requests that left the machine: {outside}"
    assert requests and requests[0].startswith("file:")
    assert screenshot.stat().st_size > 10_000
    artefacts = os.environ.get("TORCHVOTE_ARTIFACTS")
    if artefacts:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(artefacts) / screenshot.name)
        shutil.copy(report_page, Path(artefacts) / "explain-report.html")
