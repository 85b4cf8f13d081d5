"""actdesign: design, generate and run memory-efficient backward passes for PyTorch training.

The core package holds what every stage shares: the activation registry and expression
language, the spec format and the command-line interface. The stages live in
`actdesign.designer`, `actdesign.codegen` and `actdesign.runtime`.
"""

from ._version import __version__
from .errors import ActdesignError

__all__ = ["ActdesignError", "__version__"]
