"""Moved: the shared reference lives at ``zero_triton.reference`` again (the seed's API,
``init_states`` and ``zero_step``, is public there). This alias warns and will go."""
import warnings

from zero_triton.reference import *  # noqa: F401,F403 - the alias
from zero_triton.reference import __all__  # noqa: F401

warnings.warn("zero_triton.tools.reference moved to zero_triton.reference; import it from "
              "there", DeprecationWarning, stacklevel=2)
