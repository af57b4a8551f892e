"""What a served model's drafter opens, from environment variables (a vLLM server passes no other settings).

    REST_LAB_STORE        the static store: 'default' (REST Lab's Python store for the model's tokenizer, built on
                          first use as the CLI builds it), 'none', or a store folder
    REST_LAB_ANSWERS      the general-text store, drafted from in chat requests: 'auto' (default: the built-in one
                          for the served model when it is built, else none -- said in the log), 'default' (it must
                          be built: an error says how), 'none', or a store folder
    REST_LAB_DENSE        the dense store (the model's hidden states over the general-text store's answers), searched
                          for chat requests whose other drafts are weak: 'none' (default: in vLLM's chains it
                          brought no tokens, docs/bench/vllm-zen5-dense.md), 'auto' (the built-in one for the
                          served model when it is built and the engine runs the model eagerly, whose layers can be
                          read -- else none, said in the log), 'default' (it must be built and readable: an error
                          says how), or a store folder built for the served model
    REST_LAB_HISTORY      tokens of served outputs kept as a draft source (default 200000; 0: none)
    REST_LAB_PREDICTIONS  the model's own predictions as a draft source ("model"), taught by every step's logits:
                          'default' (starting from the table REST Lab's decoder keeps for the model, when there is
                          one; what the server learns stays in its memory and is never written back), 'session'
                          (starting empty), 'none'
    REST_LAB_STEP_COST    a step-cost file (default: the one `rest-lab calibrate-vllm` measured for this model,
                          engine and machine); what drafting at batches' ends brought is kept beside it
                          (`<name>-wave-ends.json`, serving.live.WaveEnds)
    REST_LAB_PLAIN_SAMPLING  '1' (default): a step in which no request has a draft is sampled on vLLM's plain path
                          (serving.engine.sample_plainly_without_drafts); '0': as vLLM samples it (its rejection
                          sampler, drafts or none)
    REST_LAB_PROPOSE_LOG  a JSON file the drafter rewrites at its first step and every 16 steps with its counts
                          and times (steps, drafts given and accepted, propose()'s own milliseconds, the engine's
                          between two calls, the garbage collector's passes in the worker and their milliseconds)

A store that is missing, corrupt or built with another tokenizer stops the server at start-up with the reason and
the fix; the drafter never runs silently empty.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from datastores import (
    DatastoreError,
    DenseStore,
    HistoryStore,
    RecycleStore,
    Store,
    open_answers,
    open_dense,
    open_recycle,
    open_static_store,
)
from datastores.fingerprint import tokenizer_fingerprint
from rest_base.files import write_atomic
from rest_core.cost import CostModel
from rest_core.serving.drafter import RestDrafter
from rest_core.serving.live import WaveEnds
from rest_core.serving.load import StepCost, curve_path, load_curve

log = logging.getLogger("rest_core.serving")
HISTORY_TOKENS = 200_000


def rest_lab_model_name(model: str) -> str:
    """The name REST Lab keeps a model's stores and statistics under: its default model's converted folder is
    the default model, anything else is named as served."""
    from rest_core.model import DEFAULT_MODEL, converted_default_dir  # the model module loads no weights on import

    try:
        if Path(model).expanduser().resolve() == converted_default_dir().resolve():
            return DEFAULT_MODEL
    except OSError:
        pass
    return model


def chat_markers(tokenizer: Any) -> list[int]:
    """Special token ids the chat template puts into a prompt other than the end-of-text ones (for SmolLM2:
    <|im_start|>): a prompt that starts with one of them is a chat request."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ends = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return sorted({int(t) for t in ids if t in special and t not in ends})


def _answers(model_name: str, tokenizer: Any) -> Optional[Store]:
    spec = os.environ.get("REST_LAB_ANSWERS", "auto")
    if spec != "auto":
        return open_answers(spec, model_name, tokenizer)
    try:
        return open_answers("default", model_name, tokenizer)
    except DatastoreError as err:
        log.warning("REST Lab: drafting without the general-text store (%s)", err)
        return None


def _dense(model_name: str, tokenizer: Any, layers: Optional[int], eager: bool) -> Optional[DenseStore]:
    """The dense store REST_LAB_DENSE names for the served model (`layers`: its decoder layers, None where they
    cannot be read; `eager`: whether the engine runs the model eagerly, so that a hook on a layer sees each pass).
    A store of another model or tokenizer, or a damaged one, is refused; 'auto' then serves without it."""
    spec = os.environ.get("REST_LAB_DENSE", "none").strip()
    if spec.lower() == "none":
        return None
    auto = spec.lower() == "auto"
    try:
        if layers is None:
            raise DatastoreError("the served model's layer count cannot be read; set REST_LAB_DENSE=none")
        if not eager:
            raise DatastoreError("the engine does not run the model eagerly (its passes are compiled), so no hook "
                                 "can read a layer's hidden states; serve with --enforce-eager, or set "
                                 "REST_LAB_DENSE=none")
        from rest_core.hidden import default_dense_layer

        # the decoder's opening: 'default' is the built-in store (never built here: that needs the model's passes);
        # the served model's weights are not transformers' modules, so the store's model is checked by its name
        which = "default" if spec.lower() in ("auto", "default") else str(Path(spec).expanduser())
        store = open_dense(which, model_name, tokenizer, None, default_dense_layer(layers))
        built_for = store.meta["model"].get("name")
        if built_for != model_name:
            raise DatastoreError(f"{store.path} holds the hidden states of model {built_for!r}, not of the served "
                                 f"model {model_name!r}: its neighbours would mean nothing; build one for this model "
                                 f"or set REST_LAB_DENSE=none")
        if not 1 <= store.state_layer <= layers:
            raise DatastoreError(f"{store.path} keeps hidden state {store.state_layer}, which the served model (layers "
                                 f"1..{layers}) has not; set REST_LAB_DENSE=none")
        return store
    except DatastoreError as err:
        if not auto:
            raise DatastoreError(f"REST_LAB_DENSE={spec}: {err}") from None
        log.warning("REST Lab: drafting without the dense store (%s)", err)
        return None


def step_cost(engine_key: str, calibrate_with: Sequence[str] = ()) -> StepCost:
    """The step-cost table for this engine (`engine_key`): REST_LAB_STEP_COST's file, else the one measured for
    it; a DatastoreError naming the command that measures it (`calibrate_with`: its options for this engine)."""
    path = os.environ.get("REST_LAB_STEP_COST")
    if path:
        try:
            cost = StepCost.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as err:
            raise DatastoreError(f"REST_LAB_STEP_COST={path} cannot be read ({err}); point it at a file that "
                                 f"`rest-lab calibrate-vllm` wrote, or unset it") from None
        if cost is None:
            raise DatastoreError(f"REST_LAB_STEP_COST={path} is not a step-cost file; measure one with "
                                 f"`rest-lab calibrate-vllm MODEL`")
        return cost
    cost = load_curve(engine_key)
    if cost is None:
        command = " ".join(["rest-lab calibrate-vllm MODEL", *calibrate_with])
        raise DatastoreError(f"no step cost measured for this model, engine and machine ({curve_path(engine_key)}); "
                             f"measure it once with `{command}` (a minute or two; `rest-lab serve` does it for you)")
    return cost


def wave_ends_path(engine_key: str) -> Path:
    """Where what drafting for the requests a batch ends with brought is kept (serving.live.WaveEnds): beside the
    step-cost table it was weighed with (REST_LAB_STEP_COST's file, else the one measured for this engine)."""
    table = Path(os.environ.get("REST_LAB_STEP_COST") or curve_path(engine_key)).expanduser()
    return table.with_name(f"{table.stem}-wave-ends.json")


def _predictions(name: str, tokenizer: Any, vocab_size: Optional[int]) -> Optional[RecycleStore]:
    """The table of the model's own predictions (REST_LAB_PREDICTIONS), or None without a vocabulary size (an
    engine whose logits the proposer cannot read)."""
    spec = os.environ.get("REST_LAB_PREDICTIONS", "default").strip().lower()
    if spec not in ("default", "session", "none"):
        raise DatastoreError(f"REST_LAB_PREDICTIONS must be 'default', 'session' or 'none', got {spec!r}")
    if vocab_size is None or spec == "none":
        return None
    try:  # REST Lab's own table is a cache, and it is not the server's to repair
        table = open_recycle(spec, tokenizer, vocab_size, name, repair=False)
    except DatastoreError as e:
        log.warning("REST Lab: the model's predictions start empty: the decoder's table could not be read (%s)", e)
        return RecycleStore(vocab_size)
    return table.fork()  # learns in memory: a served table is never written back


def open_drafter(model: str, tokenizer: Any, max_drafts: int, max_len: int, engine_key: str,
                 vocab_size: Optional[int] = None, calibrate_with: Sequence[str] = (), layers: Optional[int] = None,
                 eager: bool = False) -> RestDrafter:
    """The drafter for a served model, its stores opened as the environment says (see the module docstring);
    `vocab_size`: the model's (the logits' width), where the proposer hands the drafter the model's predictions;
    `calibrate_with`: the options that measure this engine's step cost, named where none was measured; `layers`
    and `eager`: the model's decoder layers and whether the engine runs it eagerly (the dense store needs both)."""
    report = propose_log()
    name = rest_lab_model_name(model)
    predictions = _predictions(name, tokenizer, vocab_size)
    static = open_static_store(os.environ.get("REST_LAB_STORE", "default"), tokenizer, progress=False)
    answers = _answers(name, tokenizer)
    try:
        history_tokens = int(os.environ.get("REST_LAB_HISTORY", HISTORY_TOKENS))
    except ValueError:
        raise DatastoreError(f"REST_LAB_HISTORY must be a number of tokens, got {os.environ['REST_LAB_HISTORY']!r}"
                             ) from None
    history = HistoryStore(path=None, max_tokens=history_tokens) if history_tokens > 0 else None
    dense = _dense(name, tokenizer, layers, eager)
    text = [s for s in (static,) if s is not None]
    chat = [s for s in (static, answers) if s is not None]
    if not chat and history is None:
        log.warning("REST Lab: no static store and no history: drafting from each request's own tokens only")
    with_history = [s for s in (history, predictions) if s is not None]
    fallback = [dense] if dense is not None else []
    choosers = {kind: CostModel.for_acceptance(name, [*stores, *with_history, *more], kind=kind)
                for kind, stores, more in (("text", text, []), ("chat", chat, fallback))}
    cost = step_cost(engine_key, calibrate_with)
    log.info("REST Lab drafting for %s: stores %s, history %s tokens, the model's predictions %s, the dense store "
             "%s, tokenizer %s, step cost %s", name, [s.label for s in chat], history_tokens,
             "off" if predictions is None else f"on ({predictions.known} tokens known)",
             "off" if dense is None else dense.describe(),
             tokenizer_fingerprint(tokenizer)[:12], engine_key)
    drafter = RestDrafter({"text": text, "chat": chat}, choosers, cost, max_drafts=max_drafts, max_len=max_len,
                          chat_markers=chat_markers(tokenizer), history=history, predictions=predictions,
                          dense=dense, wave_ends=WaveEnds(wave_ends_path(engine_key)))
    if report is not None:
        report.watch(drafter.stats)
    drafter.report = report
    return drafter


REPORT_EVERY = 16  # steps between two reports of a proposer's counts and times (after the first step's)


class ProposeLog:
    """Where a proposer reports its counts and times (REST_LAB_PROPOSE_LOG): the file is rewritten at the first
    step, so that one report holds what start-up did (the engine's collections as it loaded the model), and every
    REPORT_EVERY steps after.  A report that cannot be written is said in the log once; serving goes on."""

    def __init__(self, path: Path):
        self.path = path
        self._warned = False

    def watch(self, stats: dict) -> None:
        """Count the Python garbage collector's passes in this process and their milliseconds into `stats`
        (gc_count, gc_full, gc_ms): they stop the engine wherever they fall, inside propose() or not."""
        import gc
        import time

        stats.update(gc_count=0, gc_ms=0.0, gc_full=0)
        began = [0.0]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                began[0] = time.perf_counter()
                return
            stats["gc_count"] += 1
            stats["gc_full"] += int(info.get("generation") == 2)
            stats["gc_ms"] += (time.perf_counter() - began[0]) * 1e3

        gc.callbacks.append(timed)

    def tick(self, stats: dict) -> None:
        """One more step counted in stats["steps"]: a copy of `stats` is written when a report is due."""
        if stats["steps"] == 1 or stats["steps"] % REPORT_EVERY == 0:
            self.write(dict(stats))

    def write(self, stats: dict) -> None:
        try:
            write_atomic(self.path, json.dumps(stats).encode())
        except OSError as err:
            if not self._warned:
                self._warned = True
                log.warning("REST Lab: REST_LAB_PROPOSE_LOG=%s cannot be written (%s); serving goes on", self.path,
                            err)


def propose_log() -> Optional[ProposeLog]:
    """The report REST_LAB_PROPOSE_LOG asks for, its file tried once at start-up: a file that cannot be written
    stops the server with the reason, before any store is opened."""
    if not os.environ.get("REST_LAB_PROPOSE_LOG"):
        return None
    path = Path(os.environ["REST_LAB_PROPOSE_LOG"]).expanduser()
    try:
        write_atomic(path, b"{}")
    except OSError as err:
        raise DatastoreError(f"REST_LAB_PROPOSE_LOG={path} cannot be written ({err}); name a file in a folder "
                             "that can be written, or unset it") from None
    return ProposeLog(path)


def plain_sampling() -> bool:
    """Whether draftless steps are sampled on vLLM's plain path (REST_LAB_PLAIN_SAMPLING; a value other than 0
    or 1 is an error that names them)."""
    value = os.environ.get("REST_LAB_PLAIN_SAMPLING", "1").strip()
    if value not in ("0", "1"):
        raise DatastoreError(f"REST_LAB_PLAIN_SAMPLING={value!r}: set it to 1 (draftless steps sampled as plain "
                             f"vLLM samples them, the default) or 0 (as vLLM samples every step with a proposer)")
    return value == "1"
