"""Shared checks for the report tests: the page references nothing outside itself."""

from __future__ import annotations

import re

import torch

URL = re.compile(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", re.IGNORECASE)
REFERENCE = re.compile(r"""\b(?:src|href|srcset|action|poster|data)\s*=\s*["']?([^"'\s>]*)""", re.IGNORECASE)


def offline_problems(page: str) -> list[str]:
    """Every URL, and every src=/href= that is not a data: URI or an in-page #anchor."""
    problems = [f"url: {m.group(0)}" for m in URL.finditer(page)]
    for match in REFERENCE.finditer(page):
        target = match.group(1)
        if not (target.startswith("data:") or target.startswith("#")):
            problems.append(f"reference: {match.group(0)[:80]}")
    if re.search(r"<script|<link\b|@import|url\(", page, re.IGNORECASE):
        problems.append("script, link, @import or url() in the page")
    return problems


def synthetic_record(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every key :func:`torchvote.explain.record.explain_record` draws, with plausible shapes."""
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=generator)
    passes, batch, outs, ins, dims = 3, 4, 10, 12, 16
    couplings = torch.softmax(
        torch.randn(passes, batch, outs, ins, generator=generator) * torch.arange(1.0, 4.0).view(3, 1, 1, 1),
        dim=-2,
    )  # (t, b, i, j), sharper every pass
    return {
        "couplings": couplings,
        "votes": torch.randn(batch, outs, ins, dims, generator=generator),
        "outputs": torch.randn(passes, batch, outs, dims, generator=generator),
        "inputs": rand(5, 28, 28),
        "reconstructions": rand(5, 28, 28),
        "perturbations": rand(16, 11, 28, 28),
        "multimnist_inputs": rand(3, 36, 36),
        "multimnist_first": rand(3, 36, 36),
        "multimnist_second": rand(3, 36, 36),
        "patch_image": rand(28, 28),
        "patch_attention": torch.softmax(torch.randn(16, generator=generator), dim=0),
        "patch_grid": torch.tensor([4, 4]),
    }
