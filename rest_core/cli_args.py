"""Command-line arguments shared by `generate` and `bench`: model, stores, retrieval, sampling."""
from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Optional

from datastores import DatastoreError, DenseStore, TokenDatastore, open_answers
from rest_core.decode import DecodeConfig
from rest_core.hidden import open_model_dense
from rest_core.model import LoadedModel, generate_batch
from rest_core.retrieve import MAX_MATCHES, RetrieveSettings
from rest_core.sampling import Sampling


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    """Model, store and decoding settings shared by generate and bench."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="hub id or local folder (default: SmolLM2-135M-Instruct, offline)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--dtype", default=None, help="float32 (default), float16 or bfloat16 (GPU only)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")
    g = p.add_argument_group("stores")
    g.add_argument("--datastore", default="default",
                   help="'default' (Python sources, built on first use), 'none', or a store folder")
    g.add_argument("--answers", default="auto",
                   help="the general-text store (the model's own answers to varied requests, built once per model "
                        "on first use): 'auto' (default: with chat prompts only), 'default', 'none', or a store folder")
    g.add_argument("--dense", default="auto",
                   help="the dense store (the model's hidden states over the general-text store's answers, searched "
                        "for the places nearest the model's state now; built once per model): 'auto' (default: with "
                        "chat prompts only), 'default', 'none', or a store folder")
    g.add_argument("--no-request-store", action="store_true", help="do not draft from the prompt and answer so far")
    g.add_argument("--history", default="none",
                   help="'none' (default), 'default' (persisted past answers) or a history file")
    g.add_argument("--model-drafts", default="default",
                   help="the model's own predictions as drafts (recycled tokens): 'default' (kept per model "
                        "between runs), 'session' (start empty), 'none', or a table file")
    g = p.add_argument_group("retrieval and drafting")
    g.add_argument("--n-max", type=int, default=16, help="longest context suffix looked up (default 16)")
    g.add_argument("--n-min", type=int, default=2, help="shortest suffix that counts as a match (default 2)")
    g.add_argument("--max-matches", type=int, default=MAX_MATCHES,
                   help=f"continuations taken per store (default {MAX_MATCHES})")
    g.add_argument("--continuation-len", type=int, default=24,
                   help="tokens per continuation, the deepest a draft branch goes (default 24; the cost model keeps a "
                        "branch only as deep as its chance of acceptance pays)")
    g.add_argument("--budget", default="auto",
                   help="draft tokens per step, or 'auto' to follow the measured cost model (default)")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    """The DecodeConfig the parsed arguments ask for (ValueError with the fix for a bad --budget)."""
    if args.budget == "auto":
        budget = None
    else:
        try:
            budget = int(args.budget)
        except ValueError:
            raise ValueError(f"--budget must be a whole number or 'auto', got {args.budget!r}.") from None
    return DecodeConfig(max_new_tokens=args.max_new_tokens,
                        sampling=Sampling(args.temperature, args.top_k, args.top_p, args.seed),
                        retrieve=RetrieveSettings(args.n_max, args.n_min, args.max_matches, args.continuation_len),
                        draft_budget=budget, stop_at_eos=not args.no_eos)


def answers_for(args: argparse.Namespace, lm: LoadedModel, chat: bool) -> Optional[TokenDatastore]:
    """The general-text store --answers asks for ('auto': the built-in one for chat prompts only), built
    now (a few minutes, once per model) when it does not exist yet."""
    spec = getattr(args, "answers", "auto")
    if spec == "auto":
        spec = "default" if chat and getattr(lm.tokenizer, "chat_template", None) else "none"
    return open_answers(spec, lm.name, lm.tokenizer, generate=partial(generate_batch, lm))


def dense_for(args: argparse.Namespace, lm: LoadedModel, chat: bool, build: bool = True) -> Optional[DenseStore]:
    """The dense store --dense asks for ('auto': the built-in one for chat prompts only).  'default' builds it now
    (with the general-text store it reads, when missing) the first time; so does 'auto' when `build` is set (a
    benchmark), else 'auto' drafts without it until it is built and says how to build it (a first chat is not kept
    waiting for minutes)."""
    spec = getattr(args, "dense", "auto")
    if spec != "auto":
        return open_model_dense(lm, spec)
    if not (chat and getattr(lm.tokenizer, "chat_template", None)):
        return None
    if build:
        return open_model_dense(lm, "default")
    try:
        return open_model_dense(lm, "default", build=False)
    except DatastoreError as err:
        print(f"note: drafting without the dense store: {err}", file=sys.stderr)
        return None
