"""The version `vlmserve --version` and the server's banner say."""

from __future__ import annotations

__version__ = "0.1.0"  # pyproject.toml's [project] version


def package_version() -> str:
    """The installed distribution's version (what pip sees), else this source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vlmserve")
    except PackageNotFoundError:
        return __version__
