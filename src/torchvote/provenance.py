"""What code made a result: torchvote's version and, from a git checkout, its commit.

A run's weights (every checkpoint of :func:`~torchvote.training.train`) and each finished run of
``torchvote reproduce`` record :func:`describe_code`, so that a number can be traced to the code
that measured it even where the run's configuration did not change between two versions.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["describe_code"]


def describe_code(source: str | Path | None = None) -> str:
    """The code a run is measured with, in words: torchvote's version and, where the package runs
    from a git checkout, its commit and whether files tracked there have changed since.

    A finished run's record keeps this, so a summary says which code made its figures (a fix
    that changes a row's numbers without changing its configuration, such as a data placement,
    leaves the folder's configuration equal to the row's: only this tells the runs apart).

    Args:
        source: a folder inside the checkout to ask (default: this package's own folder).

    Returns:
        ``"torchvote 0.1.0 at git 1a2b3c4"`` (``", with uncommitted changes"`` added where tracked
        files differ from the commit), or ``"torchvote 0.1.0"`` outside a git checkout, in a
        folder the checkout does not track (an environment inside another project), or without
        git.
    """
    import subprocess

    from torchvote import __version__

    folder = Path(source) if source is not None else Path(__file__).resolve().parent

    def git(*words: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(folder), *words], capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):  # no git, or it hung
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    text = f"torchvote {__version__}"
    # a package installed into a virtual environment inside another project's checkout is not
    # that project's code: the folder's own files must be tracked there
    tracked = git("ls-files", "--", ".")
    commit = git("rev-parse", "--short", "HEAD") if tracked else None
    if commit:
        text += f" at git {commit}"
        if git("status", "--porcelain", "--untracked-files=no"):
            text += ", with uncommitted changes"
    return text
