"""See the votes: pictures of attention and routing drawn from recorded tensors, and one offline HTML report.

- :mod:`~torchvote.explain.statistics`: the numbers (rollout, coupling entropy, agreement, PCA of
  votes, perturbed poses, patch maps, top attended tokens); pure functions on tensors.
- :mod:`~torchvote.explain.attention_plots` and :mod:`~torchvote.explain.capsule_plots`: matplotlib
  figures (extra ``torchvote[plots]``), saved as PNG and SVG by :func:`save_figure`.
- :class:`HtmlReport`: one self-contained page; :func:`explain_sentences` fills it from the
  pretrained encoder (extra ``torchvote[pretrained]``); :func:`explain_record` from recorded capsule
  tensors; :func:`add_explain_arguments` / :func:`run_explain` are the ``torchvote explain`` command.
"""

from torchvote.explain.figures import save_figure
from torchvote.explain.report import HtmlReport
from torchvote.explain.statistics import (
    attention_rollout,
    coupling_entropy,
    patch_attention_map,
    perturbation_poses,
    project_votes,
    routing_agreement,
    top_attended,
)

__all__ = [
    "HtmlReport",
    "attention_rollout",
    "coupling_entropy",
    "patch_attention_map",
    "perturbation_poses",
    "project_votes",
    "routing_agreement",
    "save_figure",
    "top_attended",
]
