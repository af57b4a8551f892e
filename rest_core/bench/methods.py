"""The benchmark's methods, and one run of a method on one prompt, measured.

Nothing here is estimated: forward passes, query sizes and forward times come from
hooks on the model (`ForwardLog`), drafts and acceptances from the decoders' own counts.

Methods
  plain             our plain autoregressive loop
  hf_greedy         transformers generate(do_sample=False): the reference output
  hf_prompt_lookup  transformers generate(prompt_lookup_num_tokens=10)
  rest_static       REST with the static store only (the paper's method)
  rest_full         static + answers (when the run has it) + request + history + model stores; the history is in memory
                    and holds this run's earlier answers of rest_full (empty at first)
  rest_model        the model's own predictions only (recycled tokens, source "model")
  rest_answers      the general-text store only (the model's own answers to varied requests,
                    source "answers"); offered when the run has that store (chat, by default)
  rest_dense        the dense store only (neighbours of the model's hidden state among its own answers, source
                    "dense"); offered when the run has that store (chat, by default); rest_full drafts from it too
  rest_static_traced  (opt-in) rest_static with every step recorded to SQLite
  rest_text         (opt-in) rest_full without the dense store: beside rest_full, what the dense source adds
  <method>@default  (with --kernels-ab) the method with transformers' default linear kernels and torch's
                    SDPA attention instead of the ones chosen on this machine (rest_core.kernels,
                    rest_core.attention); its own stores and cost model

Each method with the model source (rest_full, rest_model) has its own in-memory table of
the model's predictions (`RecycleStore`), empty at first, that learns from every forward
pass of that method over the run's prompts, like rest_full's history.  `reset_learned`
empties the history and the tables (the runner calls it before every round).
"""
from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from datastores import (
    HistoryStore,
    RecycleStore,
    Store,
    assemble_stores,
    open_answers,
    open_default_store,
    store_labels,
)
from rest_core.compare import cut_at_eos
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, DecodeResult, RestDecoder, check_prompt, plain_generate
from rest_core.kv_cache import new_cache
from rest_core.model import LoadedModel
from rest_core.traces.recorder import TraceRecorder

GREEDY_METHODS = ("plain", "hf_greedy", "hf_prompt_lookup", "rest_static", "rest_full", "rest_model", "rest_answers",
                  "rest_dense")
SAMPLING_METHODS = ("plain", "rest_static", "rest_full", "rest_model", "rest_answers", "rest_dense")
ANSWERS_METHOD = "rest_answers"  # needs the general-text store
DENSE_METHOD = "rest_dense"  # needs the dense store
# opt-in: rest_static with every step recorded to SQLite, to measure the recorder's overhead
TRACED = "rest_static_traced"
TEXT_METHOD = "rest_text"  # opt-in: rest_full without the dense store
SPECULATIVE = ("hf_prompt_lookup", "rest_static", "rest_full", "rest_model", "rest_answers", "rest_dense", TEXT_METHOD)
REST_METHODS = ("rest_static", "rest_full", "rest_model", "rest_answers", "rest_dense", TRACED, TEXT_METHOD)
FULL_METHODS = ("rest_full", TEXT_METHOD)  # every text source, a history of the run's own answers
MODEL_SOURCE_METHODS = (*FULL_METHODS, "rest_model")  # each gets its own table of the model's predictions
DEFAULT_KERNELS = "@default"  # method suffix: run with transformers' default linear kernels and SDPA


def rest_full_stores(lm: LoadedModel, suite: str, model: RecycleStore | None = None,
                     dense: Store | None = None, answers: str | Path | None = None) -> tuple[list[Store], str]:
    """rest_full's stores for a measurement script, and the kind of text the suite decodes: the Python
    store, the general-text store in chat (`answers`: a store folder instead of the built-in one), the request
    store, a history, the model's own predictions (the last two in memory and empty; `model` replaces the
    default model source, e.g. one drafting wider) and `dense` when given."""
    chat = suite == "chat"
    stores = assemble_stores(static=open_default_store(lm.tokenizer, progress=False),
                             answers=open_answers(str(answers or "default"), lm.name, lm.tokenizer) if chat else None,
                             request=True, history=HistoryStore(path=None),
                             model=model if model is not None else RecycleStore(lm.vocab_size), dense=dense)
    return stores, "chat" if chat else "text"


def rest_full_decoders(lm: LoadedModel, suite: str, variants: Sequence[str],
                       setup: Callable[[str, list[Store], CostModel], None]) -> dict[str, RestDecoder]:
    """One decoder per variant for a side-by-side script, each with its own `rest_full` stores (the history and
    the model's own predictions empty) and cost model (the acceptance counts as saved on disk), after
    `setup(variant, stores, cost_model)` made it that variant."""
    decoders = {}
    for variant in variants:
        stores, kind = rest_full_stores(lm, suite)
        chooser = CostModel.for_model(lm, stores=stores, kind=kind)
        setup(variant, stores, chooser)
        decoders[variant] = RestDecoder(lm, stores=stores, budget_chooser=chooser)
    return decoders


def suite_arguments(ap, rounds: int) -> None:
    """The arguments every side-by-side script takes: the suite, how many of its prompts or which, rounds, length."""
    ap.add_argument("--suite", choices=("chat", "humaneval"), default="chat")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--prompts", nargs="+", metavar="ID", help="only these prompt ids (shell patterns work)")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--max-new-tokens", type=int, default=128)


def base_method(method: str) -> str:
    """The method without its kernel variant: 'rest_full@default' -> 'rest_full'."""
    return method.split("@", 1)[0]


@contextmanager
def kernel_variant(lm: LoadedModel, method: str) -> Iterator[None]:
    """Run `method` with the kernels it names: transformers' linear layers and torch's SDPA attention for
    '<m>@default', else the ones chosen on this machine."""
    choices = [c for c in (lm.kernels, lm.attention) if c is not None]
    was = [c.enabled for c in choices]
    for c in choices:
        c.enabled = not method.endswith(DEFAULT_KERNELS)
    try:
        yield
    finally:
        for c, on in zip(choices, was):
            c.enabled = on


class ForwardLog:
    """Hooks on the model: the query length and wall time (ms) of every forward call."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.calls: list[tuple[int, float]] = []
        self._q = 0
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._q = int(ids.shape[1]) if ids is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.calls.append((self._q, (time.perf_counter() - self._t0) * 1e3))

    def reset(self) -> None:
        self.calls = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class MethodRunner:
    """Runs any method on a prompt and returns one raw record (numbers only measured here)."""

    def __init__(self, lm: LoadedModel, static_store: Store | None, cfg: DecodeConfig, methods: Sequence[str],
                 prompt_lookup_tokens: int = 10, answers_store: Store | None = None, kind: str = "text",
                 dense_store: Store | None = None):
        self.lm, self.cfg, self.methods = lm, cfg, tuple(methods)
        self.kind = kind  # "chat" or "text": the budget choosers learn acceptance per kind of prompt
        self.answers_store, self.dense_store = answers_store, dense_store
        if answers_store is None and any(base_method(m) == ANSWERS_METHOD for m in self.methods):
            raise ValueError("rest_answers needs the general-text store: pass --answers default (or a store folder).")
        if dense_store is None and any(base_method(m) == DENSE_METHOD for m in self.methods):
            raise ValueError("rest_dense needs the dense store: pass --dense default (or a store folder).")
        self.eos = lm.eos_token_ids
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.cost_model = CostModel.for_model(lm)  # the calibrated curve, for the relative verify cost
        self.static_store = static_store
        self.histories: dict[str, HistoryStore] = {}  # rest_full (and its kernel variant) -> its history
        self.model_drafts: dict[str, RecycleStore] = {}  # method -> its own table of the model's predictions
        self.trace_dir: Path | None = None
        self.recorder: TraceRecorder | None = None
        if TRACED in self.methods:
            self.trace_dir = Path(tempfile.mkdtemp(prefix="rest-bench-trace-"))
            self.recorder = TraceRecorder(self.trace_dir / "trace.sqlite")
        self._fresh_learned_stores()
        self.decoders = {}
        for m in self.methods:
            if base_method(m) in REST_METHODS:
                with kernel_variant(lm, m):  # the cost model's curve is the one of the kernels the method uses
                    self.decoders[m] = self._decoder(m)
        self.log = ForwardLog(lm.model, lm.device)

    @property
    def history(self) -> HistoryStore | None:
        """rest_full's history store (None without rest_full)."""
        return self.histories.get("rest_full")

    def _fresh_learned_stores(self) -> None:
        """New, empty stores that learn during the run: rest_full's history, one model table per method."""
        self.histories = {m: HistoryStore(path=None, n_max=self.cfg.retrieve.n_max, n_min=self.cfg.retrieve.n_min)
                          for m in self.methods if base_method(m) in FULL_METHODS}
        self.model_drafts = {m: RecycleStore(self.lm.vocab_size) for m in self.methods
                             if base_method(m) in MODEL_SOURCE_METHODS}

    def _stores(self, method: str) -> list[Store]:
        """rest_static (and its traced twin): static only; rest_full: static, answers, request, history, model
        and dense; rest_text: rest_full's without dense; rest_model: model only; rest_answers: answers only;
        rest_dense: dense only."""
        base = base_method(method)
        full = base in FULL_METHODS
        alone = ("rest_model", ANSWERS_METHOD, DENSE_METHOD)
        return assemble_stores(static=None if base in alone else self.static_store,
                               answers=self.answers_store if base in (*FULL_METHODS, ANSWERS_METHOD) else None,
                               request=full, history=self.histories.get(method), model=self.model_drafts.get(method),
                               dense=self.dense_store if base in ("rest_full", DENSE_METHOD) else None,
                               n_max=self.cfg.retrieve.n_max, n_min=self.cfg.retrieve.n_min)

    def _decoder(self, method: str) -> RestDecoder:
        stores = self._stores(method)
        auto = self.cfg.draft_budget is None  # a fixed budget needs no chooser
        return RestDecoder(self.lm, stores=stores,
                           budget_chooser=CostModel.for_model(self.lm, stores=stores, kind=self.kind) if auto else None)

    def reset_learned(self) -> None:
        """Empty the history and the model tables: what follows starts from nothing learned, as the run did.

        The budget choosers keep their acceptance counts (they are the cost model's, kept on disk)."""
        self._fresh_learned_stores()
        for m, decoder in self.decoders.items():
            decoder.stores = self._stores(m)

    def sources(self, method: str) -> list[str]:
        """The draft sources of a REST method's stores, in merge order (none for the others)."""
        return [s.source for s in self.decoders[method].stores] if method in self.decoders else []

    def close(self) -> None:
        self.log.close()

    def _sync(self) -> None:
        if self.lm.device.type == "cuda":
            torch.cuda.synchronize(self.lm.device)

    def run(self, method: str, prompt: Sequence[int], cfg: DecodeConfig | None = None,
            update_history: bool = True) -> dict:
        """One timed call of `method` on `prompt`; a failure is recorded in the record, never raised."""
        cfg = cfg or self.cfg
        rec = {"method": method, "ok": False, "error": None}
        self.log.reset()
        try:
            with kernel_variant(self.lm, method):
                if method.startswith("hf_"):
                    rec.update(self._run_hf(method, prompt, cfg))
                else:
                    rec.update(self._run_ours(method, prompt, cfg, update_history))
            rec["ok"] = True
        except Exception as err:  # any failure of a method is recorded and the run goes on
            rec["error"] = f"{type(err).__name__}: {err}"
            rec["traceback"] = traceback.format_exc(limit=4)
        finally:
            self.log.reset()
        return rec

    def _decode(self, method: str, prompt: Sequence[int], cfg: DecodeConfig, update_history: bool) -> DecodeResult:
        if base_method(method) == "plain":
            return plain_generate(self.lm, prompt, cfg)
        decoder = self.decoders[method]
        if base_method(method) != TRACED:
            return decoder.generate(prompt, cfg, update_history=update_history)
        run_id = self.recorder.start_run(model=self.lm.name, tokenizer_name=self.lm.name,
                                         stores=store_labels(decoder.stores), settings={"bench": True}, prompt="",
                                         prompt_tokens=list(prompt))
        res = decoder.generate(prompt, cfg, hook=self.recorder.step_hook(run_id, self.lm.tokenizer))
        self.recorder.finish_run(run_id, output=res.text, new_tokens=res.new_tokens, steps=res.steps,
                                 wall_s=res.wall_s, mean_accepted=res.mean_accepted)
        return res

    def _run_ours(self, method: str, prompt: Sequence[int], cfg: DecodeConfig, update_history: bool) -> dict:
        t0 = time.perf_counter()
        res = self._decode(method, prompt, cfg, update_history)
        self._sync()
        wall = time.perf_counter() - t0
        chooser = self.decoders[method].budget_chooser if method in self.decoders else None
        if chooser is not None:  # the decoder writes no files: the owner of the cost model keeps its counts
            chooser.save_stats()
        calls = list(self.log.calls)
        steps = calls[len(calls) - res.steps:] if res.steps else []
        rec = self._common(res.tokens, wall, calls, steps, forward_passes=res.steps)
        speculative = base_method(method) != "plain"
        rec.update(prefill_calls=len(calls) - res.steps, stop_reason=res.stop_reason, steps=res.steps,
                   accepted_drafts=res.accepted_drafts if speculative else 0,
                   draft_tokens=res.draft_tokens if speculative else 0,
                   no_draft_steps=res.no_draft_steps if speculative else res.steps,
                   sources=self.sources(method), drafted_by_source=dict(res.drafted_by_source),
                   accepted_by_source=dict(res.accepted_by_source),
                   retrieve_ms=[round(x, 4) for x in res.retrieve_ms], budgets=list(res.budgets),
                   phase_ms={k: round(v, 3) for k, v in res.phase_ms.items()},
                   log_consistent=len(calls) == res.steps + (len(prompt) > 1))
        return rec

    def _hf_kwargs(self, method: str, room: int, cfg: DecodeConfig) -> dict:
        eos = sorted(self.eos)
        pad = getattr(self.lm.tokenizer, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
        kw = {"max_new_tokens": room, "do_sample": False, "eos_token_id": (eos or None) if cfg.stop_at_eos else None,
                  "pad_token_id": pad}
        if base_method(method) == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        return kw

    def _run_hf(self, method: str, prompt: Sequence[int], cfg: DecodeConfig) -> dict:
        if not cfg.sampling.greedy:
            raise ValueError("The Hugging Face methods run greedy only in this benchmark.")
        room = check_prompt(self.lm, prompt, cfg)  # the same room our loops get
        ids = torch.tensor([list(prompt)], device=self.lm.device)  # (1, prompt_len)
        kw = self._hf_kwargs(method, room, cfg)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         **{self.lm.cache_kw: new_cache(self.lm.model)}, **kw)
        self._sync()
        wall = time.perf_counter() - t0
        new = [int(t) for t in out[0, len(prompt):].tolist()]
        if cfg.stop_at_eos:
            new = cut_at_eos(new, self.eos)
        calls = list(self.log.calls)
        # the first call runs the prompt (plus any first drafts) and yields the first token; later calls feed
        # the newest token plus the drafts to verify
        drafts = ([max(0, calls[0][0] - len(prompt))] if calls else []) + [q - 1 for q, _ in calls[1:]]
        rec = self._common(new, wall, calls, calls[1:], forward_passes=len(calls))
        rec.update(prefill_calls=0, steps=len(calls),
                   stop_reason="eos" if new and new[-1] in self.eos and cfg.stop_at_eos else "length",
                   accepted_drafts=max(0, len(new) - len(calls)), draft_tokens=int(sum(drafts)),
                   no_draft_steps=int(sum(d == 0 for d in drafts)), retrieve_ms=[], budgets=[], phase_ms={},
                   sources=[], drafted_by_source={}, accepted_by_source={}, log_consistent=bool(calls))
        return rec

    @staticmethod
    def _common(tokens, wall: float, calls, step_calls, forward_passes: int) -> dict:
        n = len(tokens)
        return {"tokens": [int(t) for t in tokens], "new_tokens": n, "wall_s": wall,
                "tokens_per_s": n / wall if wall > 0 else 0.0, "forward_passes": int(forward_passes),
                "forward_calls": len(calls),
                "step_query_sizes": [int(q) for q, _ in step_calls],
                "step_forward_ms": [round(ms, 4) for _, ms in step_calls]}
