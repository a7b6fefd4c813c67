"""The markdown table of `kvstitch bench decode` (`kvstitch.bench.decode.bench_decode_model` rows)."""

from __future__ import annotations

import math


def _f(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def decode_table(rows: list[dict], meta: dict) -> str:
    """Markdown table of `bench_decode_model` rows, with a one-paragraph header."""
    name = meta.get("model_name") or meta["model"].get("family", "?")
    head = (f"Decode bench: {name} on {meta['device']} ({meta['dtype']}), {meta['context_tokens']} context tokens "
            f"({meta['prompt_tokens']} prompt tokens"
            + (f"; {meta['context_requested']} requested, capped at the model's {meta['max_positions']} positions"
               if meta["capped"] else "")
            + f"), {meta['new_tokens']} decode steps"
            + (f" timed as batched steps of {meta['batch']} copies (TPOT = one step of all of them)"
               if meta.get("batch", 1) > 1 else "")
            + f", NIAH: {meta['n_niah']} x {meta['task']}; "
              f"prefill: {meta['method']}; page size {meta.get('page_size', 32)}, observation window "
              f"{meta.get('observation_window', '?')} tokens.")
    groups: dict[str, list[str]] = {}
    for p, phrase in (meta.get("budget_counts") or {}).items():
        groups.setdefault(phrase, []).append(p)
    if groups:
        head += (" Budget k = tokens attended per layer and KV head, counted as the PRKV paper counts it: "
                 + "; ".join(f"{', '.join(ps)}: {phrase}" for phrase, ps in groups.items()) + ".")
    lines = [head, "",
             "| policy | budget | context | attended | recall | oracle | oracle (KV) | min | top-1 agree | refreshes | "
             "TPOT ms | vs full | bytes bound | NIAH | note |",
             "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {_f(r['budget'], 'd')} | {r['context_tokens']} | "
            f"{_f(r.get('mean_selected_tokens'), '.0f')} | {_f(r['recall'], '.3f')} | "
            f"{_f(r['oracle_recall'], '.3f')} | {_f(r.get('oracle_recall_kv'), '.3f')} | {_f(r['recall_min'], '.3f')} | {_f(r['top1_agreement'], '.2f')} | "
            f"{_f(r.get('static_refreshes'), 'd')} | "
            f"{_f(r['tpot_ms'], '.1f')} | {_f(r['tpot_vs_full'], '.2f')} | {_f(r.get('bound_tpot'), '.2f')} | "
            f"{_f(r['niah_acc'], '.2f')}{' (%d)' % r['niah_n'] if r['niah_n'] else ''} | {r['note']} |")
    lines += ["", "attended: mean tokens attended per layer and KV head in the recall pass (k + local window at "
              "most); refreshes: static-set re-selections (all layers) during the decode (every T steps); "
              "recall / oracle / oracle (KV) / min: attention recall (PRKV Eq. 3) of the selection, of the ideal "
              "top-k with as many tokens chosen per query head, of the ideal top-k shared by the query heads of a KV "
              "group (the ceiling of any per-KV-head choice), and the lowest step x layer x head value, over the "
              "layers that select; top-1 agree: "
              "steps where the policy's greedy token equals dense decode's (teacher-forced); TPOT: median decode "
              "step; vs full: ratio to dense decode measured in the same lockstep pass; bytes bound: the lowest vs full "
              "a step reading only the weights and the attended K/V could reach (weights + k + window tokens over "
              "weights + the whole cache, float bytes; page boxes, activations and gathers left out); NIAH: mean "
              "score (samples)."]
    return "\n".join(lines)
