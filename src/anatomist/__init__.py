"""anatomist: know before you train."""

__version__ = "0.1.0"
