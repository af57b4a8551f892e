"""Command line for token datastores: build a store, describe/verify one, time its lookups.

They answer as ``python -m rest_core datastore ...`` (``rest-lab datastore ...``) and live here, above the
datastores library, because ``--tokenizer default`` means the default model's tokenizer (rest_core.model):
the library itself never imports rest_core.

    python -m rest_core datastore build OUT [--python-stdlib] [--site-packages] [--files PATH ...]
                                   [--suffix .py ...] [--jsonl FILE ... --field text]
                                   [--tokenizer default|FOLDER|HUB_ID] [--max-tokens N] [--force] [--resume]
    python -m rest_core datastore info PATH [--verify]
    python -m rest_core datastore bench STORE [--heldout PATH ...] [--tokenizer ...] [--contexts 2000]
    python -m rest_core datastore dense OUT [--files PATH ... | --jsonl FILE ...] [--layer N] [--dim 64] [--force]

Every expected failure is a DatastoreError printed as one ``error:`` line (exit 2).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from datastores import (
    DatastoreError,
    TokenDatastore,
    answers_store_path,
    build_datastore,
    build_dense_store,
    check_tokenizer,
    dense_store_path,
    open_answers,
)
from datastores.answers import answer_documents, read_kept_answers
from datastores.dense import DEFAULT_DIM
from datastores.microbench import bench_store, format_report, read_heldout
from datastores.sources import iter_jsonl, iter_python_sources, iter_text_files, site_packages_roots, stdlib_root
from rest_core.hidden import dense_layer, model_fingerprint, open_model_dense, state_reader
from rest_core.model import generate_batch, load_model
from rest_core.model import load_tokenizer as load_model_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["add_datastore_parser", "load_tokenizer", "main"]


def load_tokenizer(spec: str = "default") -> PreTrainedTokenizerBase:
    """``default`` -> the project's model tokenizer; otherwise a local folder or hub id."""
    if spec == "default":
        return load_model_tokenizer(None)
    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as exc:  # transformers raises many kinds; all mean "cannot load"
        raise DatastoreError(f"cannot load tokenizer {spec!r} ({type(exc).__name__}: {str(exc)[:200]}); "
                             "pass a folder holding tokenizer files, or a hub id that is cached locally") from None


def _add_commands(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="tokenize a corpus into a new store")
    b.add_argument("out", help="directory to create (replaced only with --force)")
    b.add_argument("--python-stdlib", action="store_true", help="this interpreter's standard library (*.py)")
    b.add_argument("--site-packages", action="store_true", help="this environment's site-packages (*.py)")
    b.add_argument("--files", nargs="+", default=[], metavar="PATH", help="text files or folders")
    b.add_argument("--suffix", nargs="+", default=None, metavar="SUFFIX", help="only --files ending so (e.g. .py .md)")
    b.add_argument("--jsonl", action="append", default=[], metavar="FILE", help="JSON lines, one document each")
    b.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    b.add_argument("--tokenizer", default="default", help="'default' (the project model's), a folder or a hub id")
    b.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    b.add_argument("--force", action="store_true", help="replace an existing store at OUT")
    b.add_argument("--resume", action="store_true",
                   help="keep tokenized batches in the cache dir; a rerun skips those already done")
    b.add_argument("--quiet", action="store_true", help="no progress bar")

    i = sub.add_parser("info", help="describe a store")
    i.add_argument("path")
    i.add_argument("--verify", action="store_true", help="also check every file's full checksum")

    d = sub.add_parser("dense", help="run the model over a corpus once and keep its hidden states (a dense store)")
    d.add_argument("out", help="directory to create (replaced only with --force); 'default': the built-in one")
    d.add_argument("--files", nargs="+", default=[], metavar="PATH", help="text files or folders (default corpus: "
                   "the general-text store's answers, each read after its request, built first when missing)")
    d.add_argument("--suffix", nargs="+", default=None, metavar="SUFFIX", help="only --files ending so")
    d.add_argument("--jsonl", action="append", default=[], metavar="FILE", help="JSON lines, one document each")
    d.add_argument("--field", default="text", help="JSONL field holding the text (default: text)")
    d.add_argument("--answers", default="default", metavar="STORE",
                   help="the general-text store whose answers make the default corpus: 'default' (the built-in one) "
                        "or a store folder built by this model")
    d.add_argument("--model", default=None, help="the model whose states are kept (default: the default model)")
    d.add_argument("--layer", type=int, default=None, help="hidden state number, as transformers counts "
                   "output_hidden_states (default: the final norm's output, the number of decoder layers)")
    d.add_argument("--dim", type=int, default=DEFAULT_DIM, help=f"PCA dimensions kept (default {DEFAULT_DIM})")
    d.add_argument("--max-tokens", type=int, default=1024, help="tokens read per document (default 1024)")
    d.add_argument("--force", action="store_true", help="replace an existing store at OUT")
    d.add_argument("--quiet", action="store_true", help="no progress line")

    m = sub.add_parser("bench", help="lookup latency percentiles")
    m.add_argument("store")
    m.add_argument("--heldout", nargs="+", default=[], metavar="PATH", help="files/folders of held-out text")
    m.add_argument("--tokenizer", default=None, help="tokenizer for --heldout (default: the store's, by name)")
    m.add_argument("--contexts", type=int, default=2000)
    m.add_argument("--context-len", type=int, default=64)
    m.add_argument("--n-max", type=int, default=16)
    m.add_argument("--n-min", type=int, default=2)
    m.add_argument("--max-matches", type=int, default=5000)
    m.add_argument("--continuation-len", type=int, default=10)
    m.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def add_datastore_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`python -m rest_core datastore build|info|bench ...`"""
    p = subparsers.add_parser("datastore", help="build, describe or time a token datastore")
    _add_commands(p)
    p.set_defaults(func=run_datastore)
    return p


def _sources(args):
    roots = []
    if args.python_stdlib:
        roots.append(stdlib_root())
    if args.site_packages:
        roots.extend(site_packages_roots())
    sources = [iter_python_sources(roots)] if roots else []
    for path in args.files:
        if not Path(path).exists():
            raise DatastoreError(f"--files path {path} does not exist; pass existing files or folders")
    if args.files:
        sources.append(iter_text_files(args.files, args.suffix))
    sources.extend(iter_jsonl(f, args.field) for f in args.jsonl)
    if not sources:
        sources = [iter_python_sources()]  # the default corpus: stdlib + site-packages
    return sources


def _cmd_build(args) -> int:
    sources = _sources(args)
    tokenizer = load_tokenizer(args.tokenizer)
    store = build_datastore(args.out, tokenizer, sources, progress=not args.quiet,
                            max_tokens=args.max_tokens, overwrite=args.force, resume=args.resume)
    b = store.meta["build"]
    print(store.describe())
    print(f"throughput: tokenize {b['tokenize_tokens_per_s']:,.0f} tokens/s, "
          f"suffix array {b['suffix_array_tokens_per_s']:,.0f} tokens/s; {b['bytes_per_token']:.2f} bytes/token")
    skipped = {k: v for s in store.meta["sources"] for k, v in s["counts"].items() if k.startswith("skipped")}
    if skipped:
        print("skipped: " + ", ".join(f"{k[8:]} {v:,}" for k, v in skipped.items()))
    return 0


def _cmd_info(args) -> int:
    store = TokenDatastore.open(args.path)
    print(store.describe())
    if args.verify:
        store.verify()
        print("verify     all checksums match")
    return 0


def _cmd_bench(args) -> int:
    store = TokenDatastore.open(args.store)
    tokenizer, texts = None, []
    if args.heldout:
        tokenizer = load_tokenizer(args.tokenizer or store.meta["tokenizer"]["name"])
        check_tokenizer(store.meta, tokenizer, store.path)
        texts = read_heldout(args.heldout)
    report = bench_store(store, tokenizer, texts, count=args.contexts, context_len=args.context_len,
                         n_max=args.n_max, n_min=args.n_min, max_matches=args.max_matches,
                         continuation_len=args.continuation_len)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _cmd_dense(args) -> int:
    lm = load_model(args.model)
    layer = args.layer if args.layer is not None else dense_layer(lm.model)
    fingerprint = model_fingerprint(lm.model)
    if args.out == "default" and not (args.files or args.jsonl) and args.answers == "default":
        if args.force:
            shutil.rmtree(dense_store_path(lm.name, lm.tokenizer, layer, args.dim), ignore_errors=True)
        print(open_model_dense(lm, "default", progress=not args.quiet, layer=layer, dim=args.dim).describe())
        return 0
    out = Path(dense_store_path(lm.name, lm.tokenizer, layer, args.dim) if args.out == "default" else args.out)
    if out.exists() and not args.force:
        raise DatastoreError(f"{out} exists: pass --force to replace it")
    if args.files or args.jsonl:
        sources = [iter_text_files(args.files, args.suffix)] if args.files else []
        sources.extend(iter_jsonl(f, args.field) for f in args.jsonl)
        docs = [(lm.tokenizer(text, add_special_tokens=False)["input_ids"][:args.max_tokens], 0)
                for source in sources for _, text in source]
        corpus = ", ".join(args.files + args.jsonl)
    else:
        if args.answers == "default":
            open_answers("default", lm.name, lm.tokenizer, generate=partial(generate_batch, lm))
        where = answers_store_path(lm.name, lm.tokenizer) if args.answers == "default" else Path(args.answers)
        docs = answer_documents(lm.tokenizer, read_kept_answers(where))
        corpus = f"the answers of the general-text store {where.name}"
    store = build_dense_store(out, docs, state_reader(lm.model, layer), lm.tokenizer,
                              {"name": lm.name, "fingerprint": fingerprint}, layer, args.dim,
                              progress=not args.quiet, corpus=corpus)
    print(store.describe())
    return 0


def run_datastore(args: argparse.Namespace) -> int:
    """Run a parsed datastore command; expected failures print one `error:` line (exit 2)."""
    try:
        return {"build": _cmd_build, "info": _cmd_info, "bench": _cmd_bench, "dense": _cmd_dense}[args.cmd](args)
    except DatastoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was published", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m rest_core datastore build|info|bench ...`"""
    p = argparse.ArgumentParser(prog="python -m rest_core datastore", description="Build and inspect REST token "
                                                                                  "datastores.")
    return run_datastore(_add_commands(p).parse_args(argv))
