"""The spec grammar of methods. It is `kvstitch.core.spec` (decode policies and the adaptive budget share it);
this module keeps the import path the method code and its callers use."""

from kvstitch.core.spec import BadSpec, Call, format_value, parse_call, split_specs

__all__ = ["BadSpec", "Call", "format_value", "parse_call", "split_specs"]
