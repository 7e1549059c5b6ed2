"""Lethe's HTTP server: schemas, app, engine, storage."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("lethe")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"
