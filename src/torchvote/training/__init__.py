"""Training and evaluation: one plain PyTorch loop for every registered model.

* :func:`train` -- run a :class:`~torchvote.training.config.TrainConfig` (resume, Ctrl-C, ``torchrun``);
  :func:`plot_run` draws its plots afterwards.
* :func:`~torchvote.training.config.load_config` -- a YAML preset plus ``key=value`` overrides
  (OmegaConf structured configs, :mod:`torchvote.training.config`).
* :func:`evaluate` -- metrics of a model on a data split; :func:`evaluate_checkpoint` from a file.
* :func:`generate_from_checkpoint` -- text from a checkpoint: a language model's continuations, a
  seq2seq model's outputs (``torchvote generate``).
* :func:`save_checkpoint` / :func:`load_model_weights` / :func:`load_model_from_checkpoint` --
  safetensors weights plus a ``weights_only`` training state, written atomically.
"""

# the module's old path, loaded before the function of its name is bound here: a later
# `from torchvote.training.evaluate import ...` then finds it loaded and leaves the function be
from torchvote.training import evaluate as _old_evaluation_path  # noqa: F401
from torchvote.training.checkpoint import (
    CheckpointError,
    CheckpointPaths,
    find_checkpoint,
    load_model_weights,
    load_training_state,
    save_checkpoint,
)
from torchvote.training.data import BatchPlan, TaskData
from torchvote.training.distributed import DistributedContext, setup_distributed
from torchvote.training.evaluation import evaluate, evaluate_checkpoint, load_data, load_model_from_checkpoint
from torchvote.training.generation import Generation, generate_from_checkpoint
from torchvote.training.loop import (
    StepInfo,
    TrainingDivergedError,
    TrainingOutOfMemoryError,
    TrainResult,
    load_run_config,
    train,
)
from torchvote.training.metrics import MetricsWriter, format_table, read_metrics
from torchvote.training.plots import plot_run
from torchvote.training.results import find_resumable_checkpoint
from torchvote.training.tasks import get_task_handler, make_objective

__all__ = [
    "BatchPlan",
    "CheckpointError",
    "CheckpointPaths",
    "DistributedContext",
    "Generation",
    "MetricsWriter",
    "StepInfo",
    "TaskData",
    "TrainResult",
    "TrainingDivergedError",
    "TrainingOutOfMemoryError",
    "evaluate",
    "evaluate_checkpoint",
    "find_checkpoint",
    "find_resumable_checkpoint",
    "format_table",
    "generate_from_checkpoint",
    "get_task_handler",
    "load_data",
    "load_model_from_checkpoint",
    "load_model_weights",
    "load_run_config",
    "load_training_state",
    "make_objective",
    "plot_run",
    "read_metrics",
    "save_checkpoint",
    "setup_distributed",
    "train",
]
