"""greyhound: find, mitigate and explain fail-slow stragglers in hybrid-parallel training."""

from greyhound.errors import GreyhoundError

__version__ = "0.1.0"
__all__ = ["GreyhoundError", "__version__"]
