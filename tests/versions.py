"""Which version of a library the tests run on: the skips for a library's known behaviour name its versions."""

from importlib.metadata import version

from packaging.version import Version


def older_than(distribution: str, than: str) -> bool:
    """Whether the installed `distribution` (as pip names it) is older than `than`."""
    return Version(version(distribution)) < Version(than)
