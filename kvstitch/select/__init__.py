"""Selection methods: which context tokens to recompute. Importing this package registers them all.

Each method is a small dataclass (`Selector`) whose fields are its options; `make_selector` builds one from
a spec string (``"deltaprop(base=infoflow,alpha_k=0.5)"``), an alias (``"infoflow_reorder_max"``) or an
object; `methods()` lists the methods, `ALIASES` the variant names kept for published commands."""

from . import basic  # noqa: F401  (registers full, naive, random)
from . import a3, ape, infoflow, oracle, prophet  # noqa: F401  (attention-based methods, APE)
from . import cacheclip, deviation, epic, grouping  # noqa: F401  (epic, cacheblend, kvshare, cacheclip, grouped)
from . import qcfuse  # noqa: F401  (query-aware selection through per-passage anchors)
from . import deltaprop  # noqa: F401  (kvstitch's own: recompute + propagated correction of the stale K/V)
from .a3 import A3
from .ape import Ape
from .context import SelectionContext
from .method import (ALIASES, SELECTORS, Selector, Wrapper, format_spec, make_selector, method_label, methods,
                     register, top_k_indices, with_options)
from .basic import Full, Naive, Random
from .cacheclip import CacheClip
from .deltaprop import DeltaProp
from .deviation import CacheBlend, KVShare
from .epic import Epic
from .grouping import Grouped
from .infoflow import InfoFlow
from .oracle import Oracle
from .prophet import Prophet
from .qcfuse import QCFuse
from .validation import check_method, check_methods, from_mapping, method_options, resolve_methods
from kvstitch.core.spec import BadSpec, parse_call, split_specs

__all__ = ["SELECTORS", "ALIASES", "SelectionContext", "Selector", "Wrapper", "check_method", "check_methods",
           "from_mapping", "make_selector", "method_label", "method_options", "methods", "register",
           "resolve_methods", "top_k_indices", "with_options", "BadSpec", "format_spec", "parse_call",
           "split_specs", "A3", "Ape", "CacheBlend", "CacheClip", "DeltaProp", "Epic", "Full", "Grouped",
           "InfoFlow", "KVShare", "Naive", "Oracle", "Prophet", "QCFuse", "Random"]
