"""See the votes: pictures of attention and routing drawn from recorded tensors, and one offline HTML report.

- :mod:`~torchvote.explain.statistics`: the numbers (rollout, coupling entropy, agreement, PCA of
  votes, perturbed poses, patch maps, top attended tokens); pure functions on tensors.
- :mod:`~torchvote.explain.attention_plots`, :mod:`~torchvote.explain.capsule_plots` and
  :mod:`~torchvote.explain.metric_plots` (training curves): matplotlib figures (extra
  ``torchvote[plots]``), saved as PNG and SVG by :func:`save_figure`; ``torchvote demo`` draws
  with them too.
- :class:`HtmlReport`: one self-contained page; :func:`~torchvote.explain.sentences.explain_sentences`
  fills it from the pretrained encoder (extra ``torchvote[pretrained]``);
  :func:`~torchvote.explain.record.explain_record` from recorded capsule tensors;
  :mod:`~torchvote.explain.command` (``add_explain_arguments``, ``run_explain``) is the
  ``torchvote explain`` command. Those three modules are imported by name, not from here.
"""

from torchvote.explain import statistics
from torchvote.explain.figures import save_figure
from torchvote.explain.report import HtmlReport
from torchvote.explain.statistics import attention_rollout as attention_rollout
from torchvote.explain.statistics import coupling_entropy as coupling_entropy
from torchvote.explain.statistics import patch_attention_map as patch_attention_map
from torchvote.explain.statistics import perturbation_poses as perturbation_poses
from torchvote.explain.statistics import project_votes as project_votes
from torchvote.explain.statistics import routing_agreement as routing_agreement
from torchvote.explain.statistics import top_attended as top_attended

__all__ = [
    *statistics.__all__,  # every statistic, re-exported above
    "HtmlReport",
    "save_figure",
]
