"""What `kvstitch bench decode` (`kvstitch.bench.decode`) checks and sets up before any work: its inputs, and
for each (policy, budget) an empty decoder sized for the model, with the options given for that policy."""

from __future__ import annotations

from kvstitch.core.errors import InputError
from kvstitch.decode.policies import is_dense, make_policy


def positive_int(name: str, value, low: int = 1) -> int:
    """``value`` if it is an integer >= ``low``, else an `InputError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_inputs(engine, context, budgets, policies, n_niah, new_tokens, method, task, policy_options,
                 page_size) -> tuple[list[int], list[str]]:
    """The bench's arguments checked before any work -> (the budgets, the sparse policies as canonical specs)."""
    from kvstitch.tasks.tasks import TASKS
    from kvstitch.select import check_method, make_selector

    positive_int("context", context)
    positive_int("new_tokens", new_tokens)
    positive_int("n_niah", n_niah, 0)
    budgets = list(dict.fromkeys(budgets))
    if not budgets:
        raise InputError("give at least one kv budget")
    for b in budgets:
        positive_int("every kv budget", b)
    # labels: canonical specs; dense is always the reference
    policies = [p for p in dict.fromkeys(make_policy(p).spec for p in policies) if not is_dense(p)]
    if not policies:
        raise InputError("give at least one sparse decode policy (dense, the reference, always runs)")
    budgeted = [p for p in policies if make_policy(p).kv_budget is not None]
    if budgeted:
        raise InputError(f"{budgeted[0]!r} sets kv_budget: the bench sweeps the budgets (--budget), not the policy")
    extra = set(policy_options or {}) - {make_policy(p).name for p in policies}
    if extra:
        raise InputError(f"policy options for {sorted(extra)}, which are not benchmarked")
    if task not in TASKS:
        raise InputError(f"unknown task {task!r}; known: {', '.join(sorted(TASKS))}")
    check_method(method)
    if make_selector(method).adjusts_decode():
        raise InputError(f"method {method!r} changes decode attention; sparse decoders cannot run after it")
    for p in policies:
        for b in budgets:  # bad policy options or a budget below the sink + window pages: fail before any work
            probe_decoder(engine, p, b, decoder_options(p, policy_options, page_size))
    return budgets, policies


def probe_decoder(engine, policy: str, budget: int, options: dict):
    """An empty decoder sized for the engine's model (checks the options and budget; tells the window)."""
    from kvstitch.decode import make_decoder

    ad = engine.adapter
    return make_decoder(policy, budget, num_layers=ad.num_layers, num_q_heads=ad.num_q_heads,
                        num_kv_heads=ad.num_kv_heads, head_dim=ad.head_dim, device=engine.device,
                        dtype=engine.dtype, **options)


def decoder_options(policy: str, policy_options: dict | None, page_size: int | None) -> dict:
    """The decoder options of ``policy`` (a spec): the fields ``policy_options`` sets for its policy name."""
    opts = dict((policy_options or {}).get(make_policy(policy).name, {}))
    if page_size is not None:
        opts["page_size"] = page_size
    return opts
