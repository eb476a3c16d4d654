"""The package's version, in a leaf of its own: the command line reads it without importing the package's
public names (``weightsync-audit --version`` loads nothing else)."""

__version__ = "0.1.0"
