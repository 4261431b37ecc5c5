"""Offline data for torchvote: MNIST and derived sets, affNIST, Shakespeare characters, toys.

Nothing is downloaded unless asked (:func:`download_mnist`, :func:`download_affnist`,
:func:`fetch_shakespeare`, or ``torchvote data ... --download``); a missing data set raises
:class:`DataNotFoundError`, whose message lists the paths checked and the one command that
provides the data. Files live in ``$TORCHVOTE_DATA/<name>/`` or ``~/.cache/torchvote/<name>/``.

Images are float32 (N, C, H, W) in [0, 1]; labels int64. Transforms work on whole batches on
the images' device and take an explicit ``torch.Generator``.
"""

from torchvote.data.affnist import (
    AFFNIST_TEST,
    download_affnist,
    find_affnist,
    load_affnist,
    load_affnist_mat,
)
from torchvote.data.affnist_style import AFFNIST_RANGES, make_affnist_style, pad_and_translate_train
from torchvote.data.digits import load_small_digits
from torchvote.data.download import MNIST_FILES, MNIST_MIRRORS, download_file, download_mnist
from torchvote.data.errors import ChecksumError, CorruptDataError, DataNotFoundError, DownloadError
from torchvote.data.idx import read_idx, write_idx
from torchvote.data.mnist import load_mnist
from torchvote.data.multimnist import (
    MultiMNIST,
    MultiMNISTSource,
    bounding_box_overlap,
    bounding_boxes,
    make_multimnist,
)
from torchvote.data.paths import data_root, dataset_dir
from torchvote.data.registry import (
    dataset_options,
    dataset_reads_files,
    dataset_splits,
    get_dataset,
    list_datasets,
)
from torchvote.data.sequences import (
    BOS,
    EOS,
    PAD,
    SEQ_SYMBOLS,
    SEQUENCE_TASKS,
    addition_task,
    copy_task,
    decode_sequence,
    encode_source,
    in_test_part,
    make_sequence_task,
    reverse_task,
    sort_task,
)
from torchvote.data.text import (
    CharVocab,
    char_lm_batches,
    fetch_shakespeare,
    load_shakespeare,
    sample_char_batch,
    shakespeare_titles,
    train_val_split,
)
from torchvote.data.transforms import (
    AffineParams,
    apply_affine,
    pad_to,
    random_affine,
    random_shift,
    sample_affine_params,
    sample_shifts,
    shift_images,
)

__all__ = [
    "AFFNIST_RANGES",
    "AFFNIST_TEST",
    "BOS",
    "EOS",
    "MNIST_FILES",
    "MNIST_MIRRORS",
    "PAD",
    "SEQUENCE_TASKS",
    "SEQ_SYMBOLS",
    "AffineParams",
    "CharVocab",
    "ChecksumError",
    "CorruptDataError",
    "DataNotFoundError",
    "DownloadError",
    "MultiMNIST",
    "MultiMNISTSource",
    "addition_task",
    "apply_affine",
    "bounding_box_overlap",
    "bounding_boxes",
    "char_lm_batches",
    "copy_task",
    "data_root",
    "dataset_dir",
    "dataset_options",
    "dataset_reads_files",
    "dataset_splits",
    "decode_sequence",
    "download_affnist",
    "download_file",
    "download_mnist",
    "encode_source",
    "fetch_shakespeare",
    "find_affnist",
    "get_dataset",
    "in_test_part",
    "list_datasets",
    "load_affnist",
    "load_affnist_mat",
    "load_mnist",
    "load_shakespeare",
    "load_small_digits",
    "make_affnist_style",
    "make_multimnist",
    "make_sequence_task",
    "pad_and_translate_train",
    "pad_to",
    "random_affine",
    "random_shift",
    "read_idx",
    "reverse_task",
    "sample_affine_params",
    "sample_char_batch",
    "sample_shifts",
    "shakespeare_titles",
    "shift_images",
    "sort_task",
    "train_val_split",
    "write_idx",
]
