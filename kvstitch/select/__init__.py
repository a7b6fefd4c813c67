"""Selection methods: which context tokens to recompute. Importing this package registers them all."""

from . import basic  # noqa: F401  (registers full, naive, random)
from . import a3, ape, infoflow, oracle, prophet  # noqa: F401  (attention-based methods, APE)
from . import cacheclip, deviation, epic, grouping  # noqa: F401  (epic, cacheblend, kvshare, cacheclip, grouped)
from . import qcfuse  # noqa: F401  (query-aware selection through per-passage anchors)
from . import deltaprop  # noqa: F401  (kvstitch's own: recompute + propagated correction of the stale K/V)
from .base import (SELECTORS, SelectionContext, Selector, check_method, check_methods, make_selector, methods,
                   register, resolve_methods, top_k_indices)

__all__ = ["SELECTORS", "SelectionContext", "Selector", "check_method", "check_methods", "make_selector", "methods",
           "register", "resolve_methods", "top_k_indices"]
