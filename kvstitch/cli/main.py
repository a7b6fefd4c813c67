"""The `kvstitch` command line (typer)."""

from __future__ import annotations

import functools
import json
import statistics
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstitch.core.errors import KVStitchError

if TYPE_CHECKING:
    from kvstitch.engine import GenerationStats

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Stitched KV-cache reuse with selective recompute for long-context RAG.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results as JSON + a markdown table).")
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True)

ModelOpt = typer.Option(None, "--model", "-m", help="embedded name (smollm2, gemma3, qwen2.5-0.5b, qwen2.5-1.5b), HF directory or .gguf file")
StoreOpt = typer.Option(None, "--store", help="chunk store: a directory, redis://host:port/db, or none (memory)")


def friendly_errors(fn):
    """One clear line and a non-zero exit for every kvstitch error (never a bare traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KVStitchError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _load(model: Optional[str], store: Optional[str] = None, dtype: Optional[str] = None):
    from kvstitch.engine import Engine

    with console.status(f"loading {model or 'the embedded model (SmolLM2-135M-Instruct)'} ..."):
        return Engine.load(model, store=store, dtype=dtype)


def _set_threads(threads: Optional[int]) -> None:
    import torch

    from kvstitch.core.errors import InputError

    if threads is not None:
        if threads < 1:
            raise InputError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


ThreadsOpt = typer.Option(None, help="torch CPU threads (default: torch's, one per core)")
DtypeOpt = typer.Option(None, help="model dtype: float32 (CPU default), bfloat16 (CUDA default; on a CPU with "
                                   "AVX512-BF16 ~1.8x faster prefill) or fast (bfloat16 where native, else float32)")


@app.command()
def methods() -> None:
    """List the selection methods with their options (name=default) and the aliases of their variants. A method
    is given as a spec everywhere: NAME, NAME(opt=value, ...) or NAME:opt=value,... (e.g. 'deltaprop(base=infoflow)')."""
    from kvstitch.select import ALIASES, SELECTORS, method_options

    for name in sorted(SELECTORS):
        cls = SELECTORS[name]
        doc = (cls.__doc__ or "").strip()
        if doc.startswith(cls.__name__ + "("):  # dataclass auto-doc: use the module's summary instead
            doc = (sys.modules[cls.__module__].__doc__ or "").strip()
        doc = doc.splitlines()[0] if doc else ""
        console.print(f"[bold]{name:<18}[/] {escape(doc)}", highlight=False)
        for opt, kind, default in method_options(name):
            console.print(f"  {escape(f'{opt}={default}'):<32} {kind}", highlight=False)
    console.print("[bold]aliases[/] (variant names, each a spec)", highlight=False)
    for alias, spec in sorted(ALIASES.items()):
        console.print(f"  {alias:<22} = {escape(spec)}", highlight=False)


def _read_messages(path: Path) -> list[dict]:
    from kvstitch.core.errors import InputError

    if not path.is_file():
        raise InputError(f"messages file {str(path)!r} does not exist or is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"messages file {str(path)!r} is not valid JSON: {e}") from None
    if isinstance(data, dict) and "messages" in data:  # a whole chat request body
        data = data["messages"]
    if not isinstance(data, list):
        raise InputError(f"messages file {str(path)!r} must hold a JSON list of {{role, content}} objects")
    return data


@app.command()
@friendly_errors
def ask(question: Optional[str] = typer.Argument(None, help="the question (the last user turn with --messages)"),
        system: Optional[str] = typer.Option(None, "--system", help="a system prompt: the request becomes a "
                                             "conversation in the model's chat template"),
        messages_file: Optional[Path] = typer.Option(None, "--messages", help="a JSON file with OpenAI-style "
                                                     "messages [{role, content}, ...] (QUESTION, if given, is "
                                                     "appended as the last user turn)"),
        chunk: Optional[list[Path]] = typer.Option(None, "--chunk", "-c",
                                                   help="a passage file (repeatable, in order)"),
        collection: Optional[str] = typer.Option(None, "--collection",
                                                 help="retrieve the passages from this collection (`kvstitch index`)"),
        top_k: int = typer.Option(4, "--top-k", help="chunks to retrieve with --collection"),
        collections_dir: Optional[Path] = typer.Option(
            None, "--collections-dir", help="where collections live (default: STORE/collections or "
                                            "$KVSTITCH_CACHE/collections)"),
        method: str = typer.Option("prophet", help="selection method, a spec: NAME or NAME(opt=value, ...), e.g. "
                                                   "'deltaprop(base=infoflow)' (see `kvstitch methods`)"),
        ratio: str = typer.Option("auto", help="recompute ratio in [0, 1], or 'auto' (rounds of growing budget "
                                               "until the answer is stable; full prefill if it never is), or an "
                                               "auto spec such as 'auto(tol=0.05)'"),
        decode: str = typer.Option("dense", "--decode", help="decode policy, a spec: dense, or a sparse one such "
                                                             "as prkv, 'prkv(static_ratio=0.5,kv_budget=512)'"),
        guard: bool = typer.Option(False, "--guard", help="verify the answer against full prefill (costs a full "
                                                          "prefill; returns full prefill's answer if they differ)"),
        compare: Optional[str] = typer.Option(None, help="also answer with this method (e.g. full)"),
        max_new_tokens: int = typer.Option(32, help="answer length cap"),
        model: Optional[str] = ModelOpt, store: Optional[str] = StoreOpt, dtype: Optional[str] = DtypeOpt,
        config: Optional[Path] = typer.Option(None, "--config", help="a TOML config (`kvstitch calibrate` writes "
                                              "one): its method, ratio, auto and model unless given here")) -> None:
    """Answer QUESTION over passage files (--chunk) or the top-k chunks of an indexed collection (--collection).
    With --system or --messages the prompt is a conversation in the model's chat template (passages after the
    system prompt); without passages it is then a plain chat (full prefill)."""
    from kvstitch.core.errors import InputError

    auto = None
    if config is not None:  # the file's settings, under the flags given on the command line
        import click

        from kvstitch.serve.config import read_answer_settings

        settings, ctx = read_answer_settings(config), click.get_current_context()
        given = {n for n in ("method", "ratio", "model", "decode") if ctx.get_parameter_source(n).name != "DEFAULT"}
        method = settings["method"] if "method" in settings and "method" not in given else method
        ratio = str(settings["ratio"]) if "ratio" in settings and "ratio" not in given else ratio
        model = settings["model"] if "model" in settings and "model" not in given else model
        decode = settings["decode"] if "decode" in settings and "decode" not in given else decode
        auto = settings.get("auto")
    messages = None
    if system is not None or messages_file is not None:
        from kvstitch.core.prompt import last_user_text

        messages = _read_messages(messages_file) if messages_file is not None else []
        if system is not None:
            if messages and messages[0].get("role") in ("system", "developer"):
                raise InputError("--system given, but the --messages file already starts with a system message")
            messages.insert(0, {"role": "system", "content": system})
        if question is not None:
            messages.append({"role": "user", "content": question})
        query = last_user_text(messages)
        if chunk and collection:
            raise InputError("pass passage files with --chunk or an indexed collection with --collection, not both")
    elif question is None:
        raise InputError("pass a QUESTION (or a conversation with --messages FILE.json)")
    else:
        query = question
        if bool(chunk) == bool(collection):
            raise InputError("pass passage files with --chunk, or an indexed collection with --collection "
                             "(one of them)")
    texts = []
    if collection:
        from kvstitch.corpus.retrieval import collections_root, retrieve

        hits = retrieve(query, collection, collections_root(store, collections_dir), top_k)
        if not hits:
            raise InputError(f"collection {collection!r} is empty")
        texts = [h.text for h in hits]
        for h in hits:
            console.print(f"[dim]#{h.rank + 1} {h.id} (score {h.score:.3f})[/]", highlight=False)
    for p in chunk or []:
        if not p.is_file():
            raise InputError(f"chunk file {str(p)!r} does not exist or is not a file")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    from kvstitch.decode import make_policy
    from kvstitch.engine.budget import AutoBudget, ratio_value
    from kvstitch.select import check_method

    ratio = ratio_value(ratio)  # a bad value fails before the model loads
    auto = None if isinstance(ratio, AutoBudget) else auto  # an auto spec on the command line: its options
    decode = make_policy(decode)  # and so does a bad decode policy
    for m in (method, compare):  # and a bad method spec
        if m is not None:
            check_method(m)
    if messages is not None and not texts:  # plain chat: nothing to stitch
        if compare:
            raise InputError("--compare needs passages (--chunk or --collection): plain chat is a full prefill")
        method = "full"
    eng = _load(model, store, dtype)
    runs = [(method, ratio)] + ([(compare, ratio)] if compare else [])
    results = [eng.generate(question if messages is None else None, texts, method=m, recompute_ratio=r,
                            max_new_tokens=max_new_tokens, messages=messages, guard="full" if guard else None,
                            auto=auto, decode=decode)
               for m, r in runs]
    for res in results:  # each method under its label (a spec may hold brackets: escaped)
        console.print(f"[bold]{escape(res.method)}[/] ({_budget_note(res.stats)}, TTFT {res.ttft_s * 1000:.0f} ms): "
                      f"{escape(res.text)}", highlight=False)
    if compare:
        console.print(f"speedup of {method} over {compare}: {results[1].ttft_s / results[0].ttft_s:.2f}x TTFT")


# The demo's default: the reference model, and `auto` as chosen on the Qwen NIAH 8K calibration split (one round
# at 10%, accepted only if a full prefill of the question over its 2 best-matching passages agrees), measured on
# the demo's candidate questions in docs/results/demo/README.md.
DEMO_MODEL = "qwen2.5-0.5b"
DEMO_AUTO = {"schedule": "0.1", "verify_chunks": 2}


def _budget_note(stats: GenerationStats) -> str:
    """"20% recomputed", or for ratio=auto "auto: 10% recomputed in 2 rounds" / "auto: full prefill after 4 rounds"."""
    used = stats.ratio_used
    note = f"{used:.0%} recomputed"
    if stats.auto_skipped == "short_context":
        note = "auto: short context, full prefill"
    elif stats.ratio == "auto" and stats.verify is not None:  # verified rounds: the check is what decided
        m = len(stats.verify["chunks"])
        last = stats.round_log[-1] if stats.round_log else {}
        note = (f"auto: {used:.0%} recomputed, confirmed by a full prefill of {m} passages" if stats.converged
                else f"auto: its {last.get('ratio', 0):.0%} round said {last.get('answer', '')[:40]!r}, a full "
                     f"prefill of {m} passages said {stats.verify['answer'][:40]!r}: full prefill answered")
    elif stats.ratio == "auto":
        note = (f"auto: {used:.0%} recomputed, converged in {stats.rounds} rounds" if stats.converged
                else f"auto: no convergence in {stats.rounds} rounds, " +
                ("full prefill" if used >= 1.0 else f"{used:.0%} recomputed"))
    if stats.cold_path == "full_prefill":
        note = "cold store: full prefill (its chunks are cached after the answer)"
    if stats.guard:
        note += ", guard: " + ("agrees with full prefill" if stats.guard["agreed"]
                               else "corrected to full prefill's answer")
    return note


@app.command()
@friendly_errors
def demo(method: str = typer.Option("deltaprop", help="stitched method to compare with full prefill"),
         ratio: str = typer.Option("auto", help="recompute ratio, or 'auto' (adaptive budget, the default), or "
                                                "an auto spec such as 'auto(schedule=[0.1],verify_chunks=2)'"),
         auto_schedule: str = typer.Option(DEMO_AUTO["schedule"],
                                           help="'auto': the rounds' ratios, comma-separated"),
         auto_verify_chunks: int = typer.Option(DEMO_AUTO["verify_chunks"],
                                                help="'auto': accept a round only if a full prefill of the question "
                                                     "over this many best-matching passages says the same (0: off, "
                                                     "rounds are compared with each other)"),
         questions: Optional[int] = typer.Option(None, "--questions", help="only the first N bundled questions"),
         model: str = typer.Option(DEMO_MODEL, "--model", "-m", help=ModelOpt.help),
         dtype: str = typer.Option("fast", help="model dtype: fast (bfloat16 where the CPU or GPU multiplies it "
                                                 "natively, else float32), float32 or bfloat16"),
         store: Optional[str] = StoreOpt) -> None:
    """The main job in one command: bundled passages and questions, answered with `full` prefill and with
    stitched reuse (by default kvstitch's own method with the adaptive budget, each round checked against a
    full prefill of the question over its two best-matching passages), answers, the budget each used and TTFT
    side by side. The default setting was chosen on a calibration split (docs/results/demo/README.md)."""
    from kvstitch.core.errors import InputError
    from kvstitch.engine.budget import AutoBudget, ratio_value
    from kvstitch.tasks.agreement import first_words_agree

    ratio = ratio_value(ratio)
    try:
        sched = tuple(float(x) for x in _csv(auto_schedule))
    except ValueError:
        raise InputError(f"--auto-schedule takes comma-separated ratios, e.g. 0.1 or 0.05,0.1; got {auto_schedule!r}") from None
    auto = AutoBudget.of({"schedule": sched, "verify_chunks": auto_verify_chunks})  # bad values fail before loading
    if isinstance(ratio, AutoBudget):  # an auto spec ("auto(tol=0.05)"): its options, not the flags'
        auto, ratio = ratio, "auto"
    data = json.loads(resources.files("kvstitch").joinpath("data/samples/demo.json").read_text())
    if questions is not None:
        if questions < 1:
            raise InputError(f"--questions must be >= 1, got {questions}")
        data["questions"] = data["questions"][:questions]
    eng = _load(model, store, dtype)
    passages = data["passages"]
    with console.status("precomputing the passages' KV caches (once; later questions reuse them) ..."):
        eng.generate(data["questions"][0]["question"], passages, method="naive", max_new_tokens=1)
    label = f"{method} {'auto' if ratio == 'auto' else f'{ratio:.0%}'}"
    if ratio != "auto":
        budget = "a fixed budget of recomputed tokens"
    elif auto.verify_chunks:
        budget = (f"rounds of {', '.join(f'{r:.0%}' for r in auto.schedule)} recomputed, each accepted only if a full "
                  f"prefill of the question over its {auto.verify_chunks} best-matching passages agrees, else full "
                  f"prefill")
    else:
        budget = "an adaptive budget of recomputed tokens"
    console.print(f"[bold]{model} ({str(eng.dtype).removeprefix('torch.')}): {len(passages)} passages, "
                  f"{eng.layout('q', passages).n_context} context tokens[/]; each question answered by full prefill "
                  f"and by {label} (stitched caches + {budget}).\n",
                  highlight=False)
    same, speedups, right = 0, [], {"full": 0, "stitched": 0}
    fixed_same, fixed_speedups = 0, []  # the same method at a fixed 20%, for contrast
    for i, q in enumerate(data["questions"], start=1):
        full = eng.generate(q["question"], passages, method="full", max_new_tokens=24)
        ours = eng.generate(q["question"], passages, method=method, recompute_ratio=ratio, max_new_tokens=24,
                            auto=auto)
        fixed = eng.generate(q["question"], passages, method=method, recompute_ratio=0.2, max_new_tokens=24)
        fixed_same += first_words_agree(fixed.text, full.text)
        fixed_speedups.append(full.ttft_s / fixed.ttft_s)
        agree = first_words_agree(ours.text, full.text)
        same += agree
        speedups.append(full.ttft_s / ours.ttft_s)
        console.print(_demo_block(i, q, full, ours, label, agree, speedups[-1], right), highlight=False)
    n = len(data["questions"])
    console.print(f"\n[bold]{label}[/] says what full prefill says (first 12 words) in [bold]{same}/{n}[/] answers, "
                  f"median TTFT speed-up [bold]{statistics.median(speedups):.1f}x[/]; answers containing the "
                  f"expected text: full {right['full']}/{n}, {label} {right['stitched']}/{n}.", highlight=False)
    console.print(f"For contrast, {method} at a fixed 20%: says what full prefill says in {fixed_same}/{n} answers, "
                  f"median TTFT speed-up {statistics.median(fixed_speedups):.1f}x.", highlight=False)
    st = eng.store.stats()
    console.print(f"Chunk store: {len(passages)} passages precomputed once, then reused {st.get('hits', 0)} times "
                  f"({st.get('bytes_loaded', 0) / 2**20:.0f} MiB of KV read, {st.get('storage_dtype')})"
                  + (f"; {st['problems']} unreadable entries recomputed" if st.get("problems") else "") + ".",
                  highlight=False)


def _demo_block(i: int, q: dict, full, ours, label: str, agree: bool, speedup: float, right: dict):
    """One question of the demo as a block that wraps within the terminal's width (80 columns and up)."""
    from rich.console import Group
    from rich.text import Text

    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=3)
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(ratio=1)
    for key, name, res in (("full", "full prefill", full), ("stitched", label, ours)):
        ok = q["answer"].lower() in res.text.lower()  # RULER-style string match
        right[key] += ok
        grid.add_row("", name, f"{res.ttft_s:.2f} s", Text(f"{'✓' if ok else '✗'} {res.text}"))
    pace = f"{speedup:.1f}x faster" if speedup >= 1 else f"{1 / speedup:.1f}x slower"  # "0.6x faster" misleads
    verdict = f"same answer, {pace}" if agree else f"DIFFERENT answer, {pace}"
    grid.add_row("", "", "", Text(f"{verdict}; {_budget_note(ours.stats)}", style="green" if agree else "red"))
    head = Text.assemble((f"{i}. {q['question']}", "bold"), f"  (expected: {q['answer']})")
    return Group(head, grid)


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


@bench_app.command("ttft")
@friendly_errors
def bench_ttft_cmd(lengths: str = typer.Option("2048,4096,8192", help="context lengths in tokens"),
                   methods: str = typer.Option("random", help="comma-separated methods (full is always run)"),
                   ratio: float = typer.Option(0.2), repeats: int = typer.Option(3),
                   chunk_tokens: int = typer.Option(256),
                   cold: bool = typer.Option(True, help="also time the first method with a cold and a half-warm "
                                                        "store (the engine's cold path)"),
                   cold_path: str = typer.Option("auto", help="cold-path policy: auto, full_prefill or stitched "
                                                              "(kvstitch.engine.cold)"),
                   threads: Optional[int] = ThreadsOpt, dtype: Optional[str] = DtypeOpt,
                   out: Path = typer.Option(Path("docs/results"), help="output directory"),
                   model: Optional[str] = ModelOpt, store: Optional[str] = StoreOpt) -> None:
    """Full-prefill TTFT vs stitched TTFT (warm and cold chunk store), ratios measured in one run, with
    the stage breakdown (attention kernel vs MLP, the selection's causal work and its bound)."""
    import torch

    from kvstitch.bench.ttft import bench_ttft, ttft_table, write_results

    from kvstitch.engine.cold import check_cold_path

    check_cold_path(cold_path, 0.5)
    _set_threads(threads)
    eng = _load(model, store, dtype)
    eng.cold_path = cold_path
    rows = bench_ttft(eng, _csv_ints(lengths), _csv(methods), ratio, repeats, chunk_tokens, cold=cold)
    table = ttft_table(rows)
    write_results(rows, out, "bench_ttft", table, {"model": eng.adapter.describe(), "device": str(eng.device),
                                                   "dtype": str(eng.dtype), "store": repr(eng.store),
                                                   "threads": torch.get_num_threads()})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_ttft.json'}, {out / 'bench_ttft.md'}")


@bench_app.command("serve")
@friendly_errors
def bench_serve_cmd(concurrency: str = typer.Option("1,4,16", help="comma-separated client concurrencies"),
                    requests: int = typer.Option(32, help="requests in the fixed mix"),
                    docs: int = typer.Option(8, help="documents in the shared set"),
                    doc_tokens: int = typer.Option(256, help="tokens per document"),
                    docs_per_request: int = typer.Option(4, help="documents per request"),
                    max_tokens: int = typer.Option(32, help="max_tokens (every other request half of it)"),
                    methods: str = typer.Option("prophet,random", help="methods the requests cycle through"),
                    ratio: float = typer.Option(0.2), max_batch: int = typer.Option(16, help="the server's max_batch"),
                    serial: bool = typer.Option(True, help="also run the serial server (max_batch=1) at the "
                                                           "highest concurrency (dense decode)"),
                    decode: str = typer.Option("dense", help="comma-separated decode policy specs, each a sweep of "
                                                             "its own (dense; prkv, quest, 'prkv(static_ratio=0.5)')"),
                    context: Optional[int] = typer.Option(None, help="long-context mode: every request has documents "
                                                                     "of its own, about this many tokens, and wants "
                                                                     "max_tokens of answer"),
                    kv_budget: Optional[int] = typer.Option(None, help="sparse decode's kv_budget (default: the server's)"),
                    kv_pool_bytes: Optional[str] = typer.Option(None, help="the server's KV pool limit, e.g. 2GiB"),
                    recall_sample: float = typer.Option(0.05, help="share of sparse decode passes whose recall is measured "
                                                                   "(those passes also attend densely: keep it small)"),
                    threads: Optional[int] = ThreadsOpt, dtype: Optional[str] = DtypeOpt,
                    out: Path = typer.Option(Path("docs/results"), help="output directory"),
                    model: Optional[str] = ModelOpt, store: Optional[str] = StoreOpt) -> None:
    """Load test of a real server on loopback: requests/s, tokens/s, TTFT and TPOT p50/p95, 429 rate, answers vs
    alone; with --decode, sparse decode policies against dense, recall and memory."""
    import torch

    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.serve import bench_serve, serve_table
    from kvstitch.select import split_specs
    from .store import parse_size

    _set_threads(threads)
    pool_bytes = parse_size(kv_pool_bytes) if kv_pool_bytes is not None else None
    policies = tuple(split_specs(decode))
    eng = _load(model, store, dtype)
    rows = bench_serve(eng, _csv_ints(concurrency), requests, docs, doc_tokens, docs_per_request, max_tokens,
                       tuple(_csv(methods)), ratio, max_batch, serial=serial, log=console.print, decode=policies,
                       context=context, kv_budget=kv_budget, kv_pool_bytes=pool_bytes, recall_sample=recall_sample)
    table = serve_table(rows)
    write_results(rows, out, "bench_serve", table, {"model": eng.adapter.describe(), "device": str(eng.device),
                                                    "store": repr(eng.store), "requests": requests, "docs": docs,
                                                    "doc_tokens": doc_tokens, "docs_per_request": docs_per_request,
                                                    "max_tokens": max_tokens, "methods": methods, "ratio": ratio,
                                                    "max_batch": max_batch, "decode": list(policies),
                                                    "context": context, "kv_budget": kv_budget,
                                                    "kv_pool_bytes": pool_bytes, "recall_sample": recall_sample,
                                                    "threads": torch.get_num_threads(), "dtype": str(eng.dtype)})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_serve.json'}, {out / 'bench_serve.md'}")


def _scalar(text: str):
    """A command-line value: int, float, true/false, none, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _policy_options(specs: list[str]) -> dict[str, dict]:
    """``["prkv.static_ratio=0.5", ...]`` -> ``{"prkv": {"static_ratio": 0.5}}``."""
    from kvstitch.core.errors import InputError

    out: dict[str, dict] = {}
    for spec in specs:
        key, eq, value = spec.partition("=")
        policy, dot, name = key.strip().partition(".")
        if not (eq and dot and policy and name):
            raise InputError(f"--policy-option takes POLICY.FIELD=VALUE (e.g. prkv.static_ratio=0.5), got {spec!r}")
        out.setdefault(policy, {})[name] = _scalar(value.strip())
    return out


@bench_app.command("decode")
@friendly_errors
def bench_decode_cmd(context: int = typer.Option(8192, help="context tokens (capped at the model's positions "
                                                           "- 256, and reported)"),
                     budget: str = typer.Option("256,512,1024", help="comma-separated KV budgets (tokens)"),
                     policies: str = typer.Option("prkv,quest,snapkv,arkvale,shadowkv", "--policies", "--decode",
                                                  help="comma-separated sparse decode policy specs, e.g. "
                                                       "'prkv(static_ratio=0.5),quest' (dense always runs)"),
                     niah: int = typer.Option(5, help="NIAH samples scored per (policy, budget); 0 = none"),
                     niah_task: str = typer.Option("niah_multikey", help="RULER task of the samples"),
                     new_tokens: int = typer.Option(160, help="decode steps for recall / TPOT (> the refresh "
                                                             "period T = 128); NIAH answer cap"),
                     method: str = typer.Option("full", help="prefill method (full or a stitched method)"),
                     ratio: float = typer.Option(0.2, help="recompute ratio of a stitched prefill method"),
                     page_size: Optional[int] = typer.Option(None, help="decoder page size (default 32, PRKV Sec. 5.1)"),
                     policy_option: Optional[list[str]] = typer.Option(
                         None, "--policy-option", "-o",
                         help="a policy field, POLICY.FIELD=VALUE (repeatable), e.g. prkv.group_reduce=max"),
                     warmup: int = typer.Option(2, help="decode steps left out of the TPOT medians"),
                     chunk_tokens: int = typer.Option(256), seed: int = typer.Option(0),
                     threads: Optional[int] = ThreadsOpt, dtype: Optional[str] = DtypeOpt,
                     out: Path = typer.Option(Path("docs/results"), help="output directory"),
                     model: Optional[str] = ModelOpt) -> None:
    """Sparse decode on a real model: attention recall, TPOT vs dense and NIAH accuracy per policy and budget."""
    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.decode import bench_decode_model, decode_table
    from kvstitch.core.errors import InputError
    from kvstitch.select import split_specs

    _set_threads(threads)
    try:
        budgets, names = _csv_ints(budget), split_specs(policies)
    except ValueError:
        raise InputError(f"--budget takes comma-separated integers, got {budget!r}") from None
    options = _policy_options(policy_option or [])
    eng = _load(model, dtype=dtype)
    cap = eng.adapter.max_positions - 256
    if context > cap:
        err_console.print(f"[yellow]note:[/] --context {context} is more than this model takes; running at "
                          f"{cap} context tokens (its {eng.adapter.max_positions} positions - 256)", highlight=False)
    rows, meta = bench_decode_model(eng, context, budgets, names, niah, new_tokens, method=method,
                                    recompute_ratio=ratio, task=niah_task, chunk_tokens=chunk_tokens, seed=seed,
                                    warmup=warmup, page_size=page_size, policy_options=options)
    meta["model_name"] = model or "smollm2"
    table = decode_table(rows, meta)
    write_results(rows, out, "bench_decode", table, meta)
    console.print(table, highlight=False, soft_wrap=True)
    console.print(f"written: {out / 'bench_decode.json'}, {out / 'bench_decode.md'}")


@app.command()
@friendly_errors
def precompute(docs_dir: Path = typer.Argument(..., help="folder of .txt/.md documents"),
               store: str = typer.Option(..., "--store", help="store directory or redis://host:port/db"),
               chunk_tokens: int = typer.Option(256, help="tokens per chunk"),
               overlap: int = typer.Option(0, help="tokens of trailing sentences repeated in the next chunk"),
               batch_size: int = typer.Option(8, help="chunks per forward"),
               storage_dtype: str = typer.Option("float16", help="float16, bfloat16, float32 or int8"),
               model: Optional[str] = ModelOpt,
               ray: bool = typer.Option(False, "--ray", help="shard the chunks across Ray workers (one model each) "
                                                          "writing into the shared --store; pip install "
                                                          "'kvstitch[ray]'"),
               ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                                         help="Ray cluster to join (default: $RAY_ADDRESS, else a "
                                                              "local cluster), e.g. auto or ray://head:10001"),
               ray_workers: int = typer.Option(2, "--ray-workers", help="Ray workers (actors), one model each"),
               threads_per_worker: int = typer.Option(1, "--threads-per-worker", help="CPU threads per Ray worker"),
               gpus_per_worker: float = typer.Option(0.0, "--gpus-per-worker", help="GPUs per Ray worker")) -> None:
    """Chunk DOCS_DIR and precompute every chunk's KV cache into the store (skips what is stored)."""
    from kvstitch.engine import Engine
    from kvstitch.core.errors import InputError
    from kvstitch.engine.precompute import precompute_directory

    if not docs_dir.is_dir():
        raise InputError(f"{str(docs_dir)!r} is not a directory")
    if ray or ray_address:
        from kvstitch.corpus.ray_precompute import precompute_ray

        rep = precompute_ray(docs_dir, store, model=model, workers=ray_workers, address=ray_address,
                             chunk_tokens=chunk_tokens, overlap=overlap, batch_size=batch_size,
                             storage_dtype=storage_dtype, threads_per_worker=threads_per_worker,
                             gpus_per_worker=gpus_per_worker)
        console.print(f"{rep.chunks} chunks ({rep.distinct} distinct): {rep.computed} computed, {rep.skipped} already "
                      f"stored, {rep.retried_batches} batches retried; {rep.tokens} tokens in {rep.seconds:.1f} s "
                      f"({rep.tokens_per_s:,.0f} tok/s) on {rep.workers} Ray workers", highlight=False)
        return
    with console.status("loading model ..."):
        eng = Engine.load(model, store=store, storage_dtype=storage_dtype)
    rep, _ = precompute_directory(eng, docs_dir, chunk_tokens, overlap, batch_size)
    console.print(f"{rep.chunks} chunks: {rep.computed} computed, {rep.skipped} already stored; "
                  f"{rep.tokens} tokens in {rep.seconds:.1f} s ({rep.tokens_per_s:,.0f} tok/s)", highlight=False)


@bench_app.command("precompute")
@friendly_errors
def bench_precompute_cmd(ray_workers: str = typer.Option("0,1,2", "--ray-workers",
                                                         help="comma-separated worker counts; 0 = single process"),
                         docs: int = typer.Option(16, help="synthetic documents"),
                         words: int = typer.Option(1500, help="words per document"),
                         chunk_tokens: int = typer.Option(256), batch_size: int = typer.Option(8),
                         threads: int = typer.Option(1, help="torch threads per process / Ray worker"),
                         ray_address: Optional[str] = typer.Option(None, "--ray-address"),
                         out: Path = typer.Option(Path("docs/results"), help="output directory"),
                         model: Optional[str] = ModelOpt) -> None:
    """Precompute throughput (tokens/s): single process vs 1, 2, ... Ray workers on the same folder."""
    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.precompute import bench_precompute, precompute_table
    from kvstitch.core.errors import InputError

    try:
        counts = _csv_ints(ray_workers)
    except ValueError:
        raise InputError(f"--ray-workers takes comma-separated integers, got {ray_workers!r}") from None
    if not counts or min(counts) < 0:
        raise InputError("--ray-workers needs worker counts >= 0 (0 = single process)")
    rows = bench_precompute(model, counts, docs, words, chunk_tokens, batch_size, threads, ray_address)
    table = precompute_table(rows)
    write_results(rows, out, "bench_precompute", table, {"model": model or "smollm2", "docs": docs, "words": words,
                                                         "chunk_tokens": chunk_tokens, "batch_size": batch_size,
                                                         "threads_per_worker": threads})
    console.print(table, highlight=False)
    console.print(f"written: {out / 'bench_precompute.json'}, {out / 'bench_precompute.md'}")


@bench_app.command("store")
@friendly_errors
def bench_store_cmd(path: Path = typer.Option(Path("/tmp/kvstitch-bench-store"), help="disk store directory"),
                    redis: Optional[str] = typer.Option(None, help="redis://host:port/db to include"),
                    out: Path = typer.Option(Path("docs/results"), help="output directory")) -> None:
    """Store load throughput (GB/s, warm and cold page cache) and bytes/token per storage dtype."""
    from kvstitch.bench.ttft import write_results
    from kvstitch.bench.store import bench_store, format_rows

    specs = ["memory", str(path)] + ([redis] if redis else [])
    rows = bench_store(specs)
    console.print(format_rows(rows))
    cols = list(rows[0])
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] +
                      ["| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |"
                       for r in rows])
    write_results(rows, out, "bench_store", table)


def _mount_optional() -> None:
    """Sub-apps owned by other modules (added as they land)."""
    from .retrieval import index_command
    from .serve import serve_command

    from .eval import compare_command, eval_command, merge_command, report_command
    from .viz import viz_command

    app.command("eval")(friendly_errors(eval_command))
    app.command("eval-compare")(friendly_errors(compare_command))
    app.command("eval-report")(friendly_errors(report_command))
    app.command("eval-merge")(friendly_errors(merge_command))
    app.command("viz")(friendly_errors(viz_command))
    app.command("index")(friendly_errors(index_command))
    app.command("serve", context_settings={"auto_envvar_prefix": "KVSTITCH"})(friendly_errors(serve_command))
    from .calibrate import calibrate_command

    app.command("calibrate")(friendly_errors(calibrate_command))
    from .store import store_app  # part of the package: a failing import is a bug to see, not to hide

    app.add_typer(store_app, name="store", help="Inspect, verify and garbage-collect a chunk store.")


_mount_optional()


def main() -> None:  # pragma: no cover
    sys.exit(app())
