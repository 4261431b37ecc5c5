"""A record for the capsule pictures, made from a training run's checkpoint.

``torchvote explain --checkpoint RUN`` draws from named tensors (see
:mod:`torchvote.explain.record`). A training checkpoint holds weights, so this module loads the
run's model, runs it on the first test images and keeps what the pictures read:

- ``couplings`` ``(t, b, i, j)``, the couplings routing pass ``t`` used (dynamic routing's pass
  1: uniform, before any agreement), and ``outputs`` ``(t, b, i, d)``, the output after that pass. The routers
  record only their last pass, so pass ``t`` is taken as the final pass of the model's own
  router run for ``t + 1`` iterations on the same votes: every router's passes are a prefix
  of a longer run (the loop never looks at how many passes remain; EM's inverse temperature
  depends on the pass index only), so these are exactly the passes of the trained
  ``iterations``-pass routing. Nothing is re-implemented here: the model's layers do the work.
- ``votes`` ``(b, i, j, d)``: the class layer's votes, materialised for these few images.
- ``multimnist_inputs``, ``multimnist_first``, ``multimnist_second`` ``(N, H, W)``, for a run
  on pairs of digits (MultiMNIST): each input with the decoder's output for its two highest-scored
  capsules, both digits as the paper reconstructs them.
- ``inputs`` / ``reconstructions`` ``(N, H, W)`` and ``perturbations`` ``(d, 11, H, W)``: the
  decoder's output for the winning capsule (the model's predicted class: by EM activations, a
  linear scorer or lengths, as the model scores), and for that capsule with one dimension moved by
  -0.25 .. 0.25 (Sabour et al. 2017, sec. 5.1, Fig. 4; ``perturbation_span`` ``()`` says 0.25), when
  the model has a decoder.

Index legend: ``t`` passes, ``b`` images, ``i`` class capsules, ``j`` primary capsules, ``d``
capsule dimensions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from torchvote.explain.statistics import PAPER_PERTURBATION_SPAN, perturbation_poses

__all__ = ["record_from_run"]


@torch.no_grad()
def record_from_run(
    run: str | Path, *, examples: int = 16, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """The tensors the capsule pictures read, from a capsule classifier's training run.

    Args:
        run: the run folder (``runs/NAME``), its ``checkpoints/`` folder (for either, the
            ``latest`` checkpoint), or either file of one checkpoint (``step-N.safetensors``,
            ``step-N.state.pt``: that checkpoint); the model is that checkpoint's, the data the
            run was evaluated on (``data.eval_name`` or ``data.name``, same root; the run's data
            options when it is the training set, as training loads it).
        examples: how many test images to record (the first of the evaluation split).
        device: where to run the model: a ``torch.device`` or a name
            :func:`~torchvote.training.evaluation.load_model_from_checkpoint` takes (``"cpu"``,
            ``"cuda:1"``, ``"auto"``).

    Returns:
        name -> tensor, the keys of :mod:`torchvote.explain.record` that this model can give, on
        the CPU whatever ``device`` is (the pictures read them there).

    Raises:
        ValueError: the run's model is not a capsule classifier with a vector class layer (say
            which models are), ``examples`` < 1, or an unknown or unavailable ``device``.
        torchvote.training.CheckpointError: nothing loadable at ``run`` (a checkpoint without
            its ``.state.pt``, which holds the run's config, too).
    """
    from torchvote.models.capsule_head import CapsuleClassifier, class_scores, decoder_classes
    from torchvote.nn.capsules import CapsuleLinear
    from torchvote.training.evaluation import load_model_from_checkpoint
    from torchvote.training.results import load_run_config
    from torchvote.training.setup import load_eval_data
    from torchvote.training.tasks import get_task_handler
    from torchvote.validation import check_positive_int

    check_positive_int(examples, "examples")
    model, spec, metadata = load_model_from_checkpoint(run, device)
    if not isinstance(model, CapsuleClassifier) or not isinstance(model.head.class_capsules, CapsuleLinear):
        raise ValueError(
            f"{run}: model {metadata.get('model')!r} has no vector capsule layer to draw; the routing "
            "pictures need a run of capsnet or efficient-capsnet (torchvote train capsnet-mnist)"
        )
    handler = get_task_handler(spec.task)
    raw = load_eval_data(handler, load_run_config(run).data, limit=examples)
    test = handler.finalize(raw, model.config)
    device = next(model.parameters()).device  # a name resolved ("auto": CUDA where torch sees it)
    images = test.tensors["images"].to(device)  # (b, c, h, w)

    primary, _ = model.capsules(images)  # (b, j, in_dim)
    head = model.head
    layer = head.class_capsules
    votes = layer.votes(primary)
    activations = head.input_activations(primary)  # (b, j) for EM routing, as the model routes
    couplings, outputs = [], []
    iterations = layer.router.iterations if layer.router.iterative else 1
    for passes in range(1, iterations + 1):
        routed = layer.router.first_passes(passes)(votes, activations=activations)
        couplings.append(routed.couplings)  # (b, i, j)
        outputs.append(routed.outputs)  # (b, i, d)
    record = {
        "couplings": torch.stack(couplings).float().cpu(),  # (t, b, i, j)
        "outputs": torch.stack(outputs).float().cpu(),  # (t, b, i, d)
        "votes": votes.materialize().float().cpu(),  # (b, i, j, d)
    }
    # the model's own prediction (EM activations, a linear scorer or lengths), as it reconstructs
    winners = decoder_classes(class_scores(routed, head.scorer), None)  # (b, 1)
    record["winners"] = winners[:, 0].cpu()  # (b,)

    decoder = head.decoder
    if decoder is not None and images.shape[1] == 1:
        poses = outputs[-1]  # (b, i, d)
        reconstructions = decoder(poses, winners)[:, 0, 0]  # (b, h, w)
        record["inputs"] = images[:, 0].float().cpu()
        record["reconstructions"] = reconstructions.float().cpu()
        winner = int(winners[0, 0])
        tweaked = perturbation_poses(poses[0, winner])  # (d, s, d)
        steps = tweaked.shape[1]
        full = poses[:1].repeat(tweaked.shape[0] * steps, 1, 1)  # (d * s, i, d)
        full[:, winner] = tweaked.flatten(0, 1)  # the decoder masks every other capsule
        chosen = winners[:1].expand(full.shape[0], 1)  # (d * s, 1)
        pictures = decoder(full, chosen)[:, 0, 0]  # (d * s, h, w)
        record["perturbations"] = pictures.unflatten(0, (-1, steps)).float().cpu()
        record["perturbation_span"] = torch.tensor(PAPER_PERTURBATION_SPAN)  # ()
        targets = test.tensors.get("targets")
        if targets is not None and targets.dim() == 2 and targets.shape[1] == 2:  # MultiMNIST's pairs
            # both digits, each from its own capsule: the two the model scores highest, as the
            # paper reconstructs them (Sabour et al. 2017, sec. 6, Fig. 5)
            pair = class_scores(routed, head.scorer).topk(2, dim=-1).indices  # (b, 2)
            both = decoder(poses, pair)[:, :, 0]  # (b, 2, h, w)
            record["multimnist_inputs"] = images[:, 0].float().cpu()
            record["multimnist_first"] = both[:, 0].float().cpu()
            record["multimnist_second"] = both[:, 1].float().cpu()
    return record
