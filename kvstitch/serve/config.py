"""One configuration for `kvstitch serve`: flags > ``KVSTITCH_*`` environment variables > a TOML file.

    kvstitch serve --config kvstitch.toml            # or KVSTITCH_CONFIG=kvstitch.toml
    KVSTITCH_PORT=9000 KVSTITCH_API_KEY=k1,k2 kvstitch serve --config kvstitch.toml --method infoflow

Every serve option has an environment variable: ``KVSTITCH_`` + its name in capitals with ``_`` for
``-`` (``--max-queue`` -> ``KVSTITCH_MAX_QUEUE``). The file holds the same names, at the top level or
under ``[serve]`` (``max_queue = 8`` or ``max-queue = 8``); an unknown name is an error, not ignored.
The effective configuration, and where each value came from, is printed once at start (keys masked).
This module reads the file; the options themselves and ``--config`` are `kvstitch.cli.serve`'s.

``method`` is a spec string (``method = "deltaprop(base=infoflow, alpha_k=0.5)"``, see `kvstitch.select`)
or a table naming the method and its options::

    [method]
    name = "deltaprop"
    alpha_k = 0.5
    base = { name = "infoflow", reorder = "max" }     # or base = "infoflow(reorder=max)"

``decode`` likewise: a policy spec (``decode = "prkv(static_ratio=0.5)"``, see `kvstitch.decode`) or a table
(``[decode]`` with ``name = "prkv"`` and its fields). ``ratio`` is a number, ``"auto"`` or an auto spec
(``ratio = "auto(tol=0.05)"``); an ``[auto]`` table (or an auto spec) holds the options of a plain ``"auto"``.
Every table is read by the one reader of option objects (`kvstitch.core.options.read_table`) and becomes the
object's canonical spec.
``[tenants.NAME]`` tables (``keys``, ``shared``) partition the store by API key (`kvstitch.serve.tenants`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvstitch.core.errors import InputError

ENV_PREFIX = "KVSTITCH"
SECRET = {"api_key"}  # options whose values are masked when the configuration is printed


RECORD = "calibration"  # a table `kvstitch calibrate` writes for people to read: no option of any command
ANSWER_SETTINGS = ("method", "ratio", "auto", "model", "decode")  # what `kvstitch ask --config` takes from the file


def read_config(path: str | Path, known: set[str]) -> dict:
    """The file's serve options (unknown names are an error): ``method``, ``decode`` and ``auto`` as their
    canonical specs, a ``[tenants]`` table as JSON; the ``[calibration]`` record is skipped."""
    p = Path(path).expanduser()
    data = load_toml(p)
    if isinstance(data.get("serve"), dict):
        data = {**{k: v for k, v in data.items() if k != "serve"}, **data["serve"]}
    out = {}
    for k, v in data.items():
        name = k.replace("-", "_")
        if name == RECORD and isinstance(v, dict):
            continue
        if name not in known:
            raise InputError(f"{p}: unknown option {k!r}; known: {', '.join(sorted(known))}")
        out[name] = json.dumps(v) if name == "tenants" and isinstance(v, dict) else v
    return _option_settings(out, p)


def _option_settings(out: dict, path) -> dict:
    """``method``, ``decode`` and ``auto`` of ``out`` (specs or tables) as their canonical specs, checked."""
    if "method" in out:
        out["method"] = method_setting(out["method"], path)
    if "decode" in out:
        out["decode"] = decode_setting(out["decode"], path)
    if "auto" in out:
        out["auto"] = auto_setting(out["auto"], path).spec
    return out


def decode_setting(value, path) -> str:
    """A config file's ``decode`` (a spec string or a table with ``name``) -> the policy's canonical spec."""
    from kvstitch.core.errors import BadDecodeOption
    from kvstitch.core.options import read_table
    from kvstitch.decode import make_policy, policies

    try:
        return make_policy(read_table(value, "decode", BadDecodeOption, policies())
                           if isinstance(value, dict) else value).spec
    except InputError as e:
        raise type(e)(f"{path}: decode: {e}") from None


def auto_setting(value, path):
    """A config file's ``auto`` (an ``[auto]`` table of options, or an auto spec) -> the `AutoBudget`."""
    from kvstitch.core.errors import BadAutoOption
    from kvstitch.core.options import read_table
    from kvstitch.engine.budget import AUTO, AutoBudget

    try:
        return AutoBudget.of(read_table(value, "auto", BadAutoOption, name=AUTO) if isinstance(value, dict)
                             else auto_spec(value))
    except InputError as e:
        raise type(e)(f"{path}: auto: {e}") from None


def auto_spec(text) -> str:
    """An auto spec as a setting may write it: ``auto(tol=0.05)``, ``auto:tol=0.05`` or just ``tol=0.05``."""
    if not isinstance(text, str):
        from kvstitch.core.errors import BadAutoOption

        raise BadAutoOption(f"auto options must be an auto spec such as 'auto(tol=0.05)', got {text!r:.60}")
    return text if re.match(r"\s*auto\s*(\(|:|$)", text, re.IGNORECASE) else f"auto:{text}"


def method_setting(value, path) -> str:
    """A config file's ``method`` (a spec string or a table) -> the method's label, checked."""
    from kvstitch.select import check_method, from_mapping

    try:
        return check_method(from_mapping(value) if isinstance(value, dict) else value)
    except InputError as e:
        raise type(e)(f"{path}: method: {e}") from None


def read_answer_settings(path: str | Path) -> dict:
    """``method``, ``ratio``, ``auto`` (its spec), ``model`` and ``decode`` from a config file (`kvstitch ask
    --config`): the keys it has among those, at the top level or under ``[serve]``; other keys are not ask's and
    are left alone."""
    data = load_toml(Path(path).expanduser())
    if isinstance(data.get("serve"), dict):
        data = {**data, **data["serve"]}
    return _option_settings({k: data[k] for k in ANSWER_SETTINGS if k in data}, path)


def load_toml(path: str | Path) -> dict:
    """A TOML file as a dict; a missing or unparsable file is an `InputError` naming it."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise InputError("reading --config needs Python >= 3.11 (tomllib) or `pip install tomli`") from None
    p = Path(path).expanduser()
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"config file not found: {p}") from None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read config file {p}: {e}") from None
    return data
