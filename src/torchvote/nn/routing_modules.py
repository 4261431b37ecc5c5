"""Where the routers lived before :mod:`torchvote.nn.routers` split them one per file; every name
of that package stays importable from here."""

from torchvote.nn import routers as _routers

__all__ = list(_routers.__all__)


def __getattr__(name: str):
    if name in __all__:
        return getattr(_routers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
