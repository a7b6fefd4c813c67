"""The `kvstitch` command line (typer): the app, its small commands (`methods`, `ask`, `precompute`) and the
table of every command (`_mount`); the other commands live in their own modules."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from kvstitch.core.errors import InputError
from kvstitch.engine.request import DEFAULT_METHOD
from kvstitch.text.chunking import DOCUMENT_CHUNK_TOKENS

from .bench import bench_app
from .common import budget_note, console, friendly_errors, load_engine
from .options import DECODE_DEFAULT, CollectionsDir, Decode, Dtype, Model, StitchAdapterOpt, Store

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Stitched KV-cache reuse with selective recompute for long-context RAG.")


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
        top_k: int = typer.Option(4, "--top-k",
                                  help="units to retrieve with --collection (its blocks of chunks, small-to-big)"),
        collections_dir: CollectionsDir = None,
        method: str = typer.Option(DEFAULT_METHOD, help="selection method, a spec: NAME or NAME(opt=value, ...), e.g. "
                                                   "'deltaprop(base=infoflow)' (see `kvstitch methods`)"),
        ratio: str = typer.Option("auto", help="recompute ratio in [0, 1], or 'auto' (rounds of growing budget "
                                               "until the answer is stable; full prefill if it never is), or an "
                                               "auto spec such as 'auto(tol=0.05)'"),
        decode: Decode = DECODE_DEFAULT,
        guard: bool = typer.Option(False, "--guard", help="verify the answer against full prefill (costs a full "
                                                          "prefill; returns full prefill's answer if they differ)"),
        compare: Optional[str] = typer.Option(None, help="also answer with this method (e.g. full)"),
        max_new_tokens: int = typer.Option(32, help="answer length cap"),
        model: Model = None, store: Store = None, dtype: Dtype = None, stitch_adapter: StitchAdapterOpt = "auto",
        config: Optional[Path] = typer.Option(None, "--config", help="a TOML config (`kvstitch calibrate` writes "
                                              "one): its method, ratio, auto and model unless given here")) -> None:
    """Answer QUESTION over passage files (--chunk) or the top-k chunks of an indexed collection (--collection).
    With --system or --messages the prompt is a conversation in the model's chat template (passages after the
    system prompt); without passages it is then a plain chat (full prefill)."""
    from kvstitch.decode import make_policy
    from kvstitch.engine.budget import AutoBudget, join_ratio, ratio_value
    from kvstitch.select import check_method

    method, ratio, model, decode, auto = _with_config(config, method, ratio, model, decode)
    messages, query = _conversation(question, system, messages_file, bool(chunk), bool(collection))
    texts = _passages(query, chunk or [], collection, top_k, store, collections_dir)
    ratio = ratio_value(ratio)  # a bad value fails before the model loads
    if not isinstance(ratio, AutoBudget):  # an auto spec on the command line: its options, else the file's
        ratio = join_ratio(ratio, auto)
    decode = make_policy(decode)  # and so does a bad decode policy
    for m in (method, compare):  # and a bad method spec
        if m is not None:
            check_method(m)
    if messages is not None and not texts:  # plain chat: nothing to stitch
        if compare:
            raise InputError("--compare needs passages (--chunk or --collection): plain chat is a full prefill")
        method = "full"
    eng = load_engine(model, store, dtype, stitch_adapter)
    runs = [(method, ratio)] + ([(compare, ratio)] if compare else [])
    results = [eng.generate(question if messages is None else None, texts, method=m, recompute_ratio=r,
                            max_new_tokens=max_new_tokens, messages=messages, guard="full" if guard else None,
                            decode=decode)
               for m, r in runs]
    for res in results:  # each method under its label (a spec may hold brackets: escaped)
        console.print(f"[bold]{escape(res.method)}[/] ({budget_note(res.stats)}, TTFT {res.ttft_s * 1000:.0f} ms): "
                      f"{escape(res.text)}", highlight=False)
    if compare:
        console.print(f"speedup of {method} over {compare}: {results[1].ttft_s / results[0].ttft_s:.2f}x TTFT")


def _with_config(config: Optional[Path], method: str, ratio: str, model: Optional[str], decode: str):
    """``ask --config``: the file's method, ratio, model and decode policy where the command line gave none ->
    (method, ratio, model, decode, the file's auto options or None)."""
    if config is None:
        return method, ratio, model, decode, None
    import click

    from kvstitch.serve.config import read_answer_settings

    settings, ctx = read_answer_settings(config), click.get_current_context()
    given = {n for n in ("method", "ratio", "model", "decode") if ctx.get_parameter_source(n).name != "DEFAULT"}
    method = settings["method"] if "method" in settings and "method" not in given else method
    ratio = str(settings["ratio"]) if "ratio" in settings and "ratio" not in given else ratio
    model = settings["model"] if "model" in settings and "model" not in given else model
    decode = settings["decode"] if "decode" in settings and "decode" not in given else decode
    return method, ratio, model, decode, settings.get("auto")


def _conversation(question: Optional[str], system: Optional[str], messages_file: Optional[Path], chunk: bool,
                  collection: bool) -> tuple[Optional[list[dict]], str]:
    """(the chat messages, or None for a plain question; the text passages are retrieved for), checking that
    exactly one source of passages is given where one is needed."""
    if system is None and messages_file is None:
        if question is None:
            raise InputError("pass a QUESTION (or a conversation with --messages FILE.json)")
        if chunk == collection:
            raise InputError("pass passage files with --chunk, or an indexed collection with --collection "
                             "(one of them)")
        return None, question
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
    return messages, query


def _passages(query: str, chunk: list[Path], collection: Optional[str], top_k: int, store: Optional[str],
              collections_dir: Optional[Path]) -> list[str]:
    """The passages' texts: the top-k of the collection for `query` (listed as retrieved), then the files."""
    texts = []
    if collection:
        from kvstitch.corpus.retrieval import collections_root, retrieve

        hits = retrieve(query, collection, collections_root(store, collections_dir), top_k)
        if not hits:
            raise InputError(f"collection {collection!r} is empty")
        texts = [h.text for h in hits]
        for h in hits:
            console.print(f"[dim]#{h.rank + 1} {h.id} (score {h.score:.3f})[/]", highlight=False)
    for p in chunk:
        if not p.is_file():
            raise InputError(f"chunk file {str(p)!r} does not exist or is not a file")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    return texts


def precompute(docs_dir: Path = typer.Argument(..., help="folder of .txt/.md documents"),
               store: str = typer.Option(..., "--store", help="store directory or redis://host:port/db"),
               chunk_tokens: int = typer.Option(DOCUMENT_CHUNK_TOKENS, help="max tokens per chunk"),
               overlap: int = typer.Option(0, help="tokens of trailing sentences repeated in the next chunk"),
               batch_size: int = typer.Option(8, help="chunks per forward"),
               storage_dtype: str = typer.Option("float16", help="float16, bfloat16, float32 or int8"),
               model: Model = None, stitch_adapter: StitchAdapterOpt = "auto",
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
    from kvstitch.engine.precompute import precompute_directory

    if not docs_dir.is_dir():
        raise InputError(f"{str(docs_dir)!r} is not a directory")
    if ray or ray_address:
        from kvstitch.corpus.ray_precompute import precompute_ray

        rep = precompute_ray(docs_dir, store, model=model, workers=ray_workers, address=ray_address,
                             chunk_tokens=chunk_tokens, overlap=overlap, batch_size=batch_size,
                             storage_dtype=storage_dtype, threads_per_worker=threads_per_worker,
                             gpus_per_worker=gpus_per_worker, stitch_adapter=stitch_adapter)
        console.print(f"{rep.chunks} chunks ({rep.distinct} distinct): {rep.computed} computed, {rep.skipped} already "
                      f"stored, {rep.retried_batches} batches retried; {rep.tokens} tokens in {rep.seconds:.1f} s "
                      f"({rep.tokens_per_s:,.0f} tok/s) on {rep.workers} Ray workers", highlight=False)
        return
    with console.status("loading model ..."):
        eng = Engine.load(model, store=store, storage_dtype=storage_dtype, stitch_adapter=stitch_adapter)
    rep, _ = precompute_directory(eng, docs_dir, chunk_tokens, overlap, batch_size)
    console.print(f"{rep.chunks} chunks: {rep.computed} computed, {rep.skipped} already stored; "
                  f"{rep.tokens} tokens in {rep.seconds:.1f} s ({rep.tokens_per_s:,.0f} tok/s)", highlight=False)



def _mount() -> None:
    """Every command, in the order `kvstitch --help` lists them."""
    from .adapt import adapt_command
    from .calibrate import calibrate_command
    from .demo import demo_command
    from .eval import compare_command, eval_command, merge_command, overview_command, report_command
    from .retrieval import index_command
    from .serve import serve_command
    from .store import store_app
    from .viz import viz_command

    app.command()(methods)
    app.command()(friendly_errors(ask))
    app.command("demo")(friendly_errors(demo_command))
    app.command()(friendly_errors(precompute))
    app.command("eval")(friendly_errors(eval_command))
    app.command("eval-compare")(friendly_errors(compare_command))
    app.command("eval-report")(friendly_errors(report_command))
    app.command("eval-merge")(friendly_errors(merge_command))
    app.command("eval-overview")(friendly_errors(overview_command))
    app.command("viz")(friendly_errors(viz_command))
    app.command("index")(friendly_errors(index_command))
    app.command("serve", context_settings={"auto_envvar_prefix": "KVSTITCH"})(friendly_errors(serve_command))
    app.command("calibrate")(friendly_errors(calibrate_command))
    app.command("adapt")(friendly_errors(adapt_command))
    app.add_typer(bench_app, name="bench")
    app.add_typer(store_app, name="store", help="Inspect, verify and garbage-collect a chunk store.")


_mount()


def main() -> None:  # pragma: no cover
    sys.exit(app())
