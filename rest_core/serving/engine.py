"""What the drafter needs to know about the vLLM engine it runs in, read from vLLM's own objects.

vLLM builds a custom proposer as `Class(vllm_config)` and calls `propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings)` with one row per running request, but hands it no request ids.  The model runner
that builds the proposer holds them (`runner.input_batch.req_ids`, in row order), so the proposer finds that runner
among its callers when it is built and reads the ids from it at every step.

Nor does vLLM hand a custom proposer the model's logits.  The runner passes the proposer its model once
(`load_model(model)`), and every row of logits a step computes comes from that model's `compute_logits`:
`watch_logits` wraps it so that each call also hands on its rows' top-k token ids (the logits themselves are
returned unchanged, so sampling and verification are untouched).  Likewise `watch_states` hooks one decoder
layer so that each pass hands on the hidden state there of the rows the dense source needs (datastores.dense).
`sample_plainly_without_drafts` changes one thing in the engine: a step in which no request has a draft is sampled
on vLLM's plain path instead of its rejection sampler (the same tokens, less work).

Nor does the proposer learn whether requests wait to be scheduled.  Where the engine core runs the model in its own
process (one GPU worker), its scheduler is among the proposer's callers at every step; `calling_scheduler` finds it
once and `waiting_requests` asks it how many requests wait.  Where the worker has a process of its own (vLLM's CPU
engine always, tensor parallelism) it is not there: None.
"""
from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any, Optional

from rest_core.machine import machine_key

log = logging.getLogger("rest_core.serving")

SEARCHED_FRAMES = 6
SCHEDULER_FRAMES = 24  # frames searched for the engine core's scheduler (propose() is about ten below its step)


def _among_callers(depth: int, frames: int, pick: Callable[[Any], Optional[Any]]) -> Optional[Any]:
    """A weak proxy of the first non-None `pick(owner)` over the `self` of the callers' frames, from `depth` frames
    up and at most `frames` of them, or None."""
    frame = sys._getframe(depth + 1)
    for _ in range(frames):
        if frame is None:
            return None
        found = pick(frame.f_locals.get("self"))
        if found is not None:
            return weakref.proxy(found)
        frame = frame.f_back
    return None


def calling_runner(depth: int = 2) -> Optional[Any]:
    """The vLLM model runner among the callers (the object whose input batch lists the running requests)."""
    return _among_callers(depth, SEARCHED_FRAMES,
                          lambda owner: owner if hasattr(type(owner), "propose_draft_token_ids") else None)


def calling_scheduler(depth: int = 2) -> Optional[Any]:
    """The vLLM scheduler whose step is among the callers (the engine core's `scheduler`, which counts the running
    and waiting requests), or None."""
    def pick(owner: Any) -> Optional[Any]:
        scheduler = getattr(owner, "scheduler", None)
        return scheduler if callable(getattr(scheduler, "get_request_counts", None)) else None

    return _among_callers(depth, SCHEDULER_FRAMES, pick)


def waiting_requests(scheduler: Any) -> Optional[int]:
    """How many requests wait to be scheduled, as the scheduler counts them; None where it cannot say."""
    try:
        return int(scheduler.get_request_counts()[1])
    except (AttributeError, IndexError, TypeError, ValueError, ReferenceError):
        return None


def watch_logits(model: Any, k: int, hand: Callable[[Any], None], wanted: Callable[[], bool] = lambda: True) -> bool:
    """Wrap `model.compute_logits` so that each call hands its rows' top-k token ids (a tensor, on the logits'
    device) to `hand`, while `wanted()` says so (the top-k reads every row's logits: about 0.03 ms a row on a
    2-core Zen 4); False where the model has no such method (nothing is wrapped)."""
    original = getattr(model, "compute_logits", None)
    if not callable(original):
        return False

    def compute_logits(*args: Any, **kwargs: Any) -> Any:
        logits = original(*args, **kwargs)
        if getattr(logits, "ndim", 0) == 2 and logits.shape[0] > 0 and wanted():
            hand(logits.topk(k, dim=-1).indices)
        return logits

    model.compute_logits = compute_logits
    return True


def watch_states(model: Any, layer: int, runner: Any, hand: Callable[[dict], None], keep: int,
                 wanted: Callable[[], bool] = lambda: True) -> bool:
    """Hook the served model's hidden state number `layer` (numbered as rest_core.hidden numbers them: i < n the
    output of decoder layer i - 1, n the final norm's) so that every forward pass the runner runs hands on, per
    request, the rows of its tokens there: {request id: ((rows, d) float32 array, the request's tokens in the
    pass)}, all of them where the request had at most `keep` tokens in the pass (a decoding request's newest token
    and its drafts), else its last row alone (a prompt: the state that predicted its first output token).

    vLLM's decoder layers return the residual stream in two parts (the layer's output and the residual it is
    added to at the next layer's norm); their sum is what transformers returns for the layer (checked against
    it: cosine at least 0.99999976 at layer 22 of SmolLM2-135M-Instruct, float32).  The pass's rows are laid out
    request by request as the runner's `query_start_loc` says.  False (nothing hooked) where the model keeps no
    decoder layers at `.model.layers` or has no such layer (rest_core.hidden.layer_module)."""
    import torch

    from rest_core.hidden import layer_count, layer_module

    try:
        module = layer_module(model, layer)
        normed = layer == layer_count(model)
    except (AttributeError, ValueError):
        return False

    said = []

    def keep_rows(module: Any, args: Any, output: Any) -> None:
        if not wanted():
            return
        try:
            batch = runner.input_batch
            n = int(batch.num_reqs)
            bounds = [int(b) for b in runner.query_start_loc.np[:n + 1]]
            req_ids = list(batch.req_ids[:n])
        except (AttributeError, ReferenceError, TypeError) as err:
            if not said:  # another vLLM's runner: the dense store gets no states, and the log says why once
                said.append(err)
                log.warning("REST Lab: the dense store gets no hidden states: this vLLM's model runner does not lay "
                            "out its requests' rows as expected (%s)", err)
            return
        hidden, residual = (output if isinstance(output, tuple) else (output, None))
        if normed:
            residual = None  # the final norm returns its output and the stream it read: the output alone
        if n == 0 or len(bounds) != n + 1 or hidden.shape[0] < bounds[-1]:
            return  # a warm-up pass, or rows laid out otherwise
        at = []
        for start, end in zip(bounds, bounds[1:]):
            at += range(start, end) if end - start <= keep else [end - 1]
        index = torch.tensor(at, dtype=torch.long, device=hidden.device)
        rows = hidden.index_select(0, index)
        if residual is not None:
            rows = rows + residual.index_select(0, index)
        rows = rows.float().cpu().numpy()
        out, i = {}, 0
        for rid, start, end in zip(req_ids, bounds, bounds[1:]):
            m = end - start if end - start <= keep else 1
            out[rid] = (rows[i:i + m], end - start)
            i += m
        hand(out)

    module.register_forward_hook(keep_rows)
    return True


def sample_plainly_without_drafts(runner: Any, counts: Optional[dict] = None) -> bool:
    """Let the runner sample a step in which no request has a draft as an engine without a proposer does.

    vLLM 0.32 samples every step of an engine that has a proposer through its rejection sampler, drafts or none;
    with none it samples each request's one token with the same sampler plain vLLM uses, after indexing, cloning and
    checking empty draft tensors (at batch 16 on a 2-core Zen 5, under cProfile, the executor's sample_tokens took
    1.03 ms a step against plain vLLM's 0.42-0.50, and 0.48-0.59 once wrapped as below).  The runner's
    `_sample(logits, spec_decode_metadata)` is wrapped so that such a step hands it no spec-decode metadata, and
    vLLM samples it on its own plain path; the tokens come back as one column per request, the shape the rejection
    sampler gives with no drafts, so the rest of the step reads them as before.  Each such step counts one in
    counts["plain_sampled"] (where given).  False (nothing wrapped) where the runner has no such method."""
    original = getattr(runner, "_sample", None)
    if not callable(original):
        return False

    def _sample(logits: Any, spec_decode_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        if spec_decode_metadata is not None and getattr(spec_decode_metadata, "max_spec_len", None) == 0:
            spec_decode_metadata = None
            if counts is not None:
                counts["plain_sampled"] = counts.get("plain_sampled", 0) + 1
        return original(logits, spec_decode_metadata, *args, **kwargs)

    runner._sample = _sample
    return True


def running_request_ids(runner: Any, rows: int) -> list[str]:
    """The ids of the first `rows` requests of the runner's batch, in the rows' order."""
    return list(runner.input_batch.req_ids[:rows])


def remaining_tokens(runner: Any, req_ids: list[str]) -> Optional[list[int]]:
    """The most tokens each request may still produce (its max_tokens less its output so far), as the runner's
    request states say; None where they do not say (no limit, or another runner)."""
    try:
        states = [runner.requests[rid] for rid in req_ids]
        return [max(int(r.sampling_params.max_tokens) - len(r.output_token_ids), 0) for r in states]
    except (AttributeError, KeyError, TypeError, ReferenceError):
        return None


def engine_settings(vllm_config: Any) -> dict:
    """The engine's settings that a step's cost depends on, as the calibration's options name them."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    return {"dtype": str(model.dtype).split(".")[-1], "tensor_parallel_size": parallel.tensor_parallel_size,
            "pipeline_parallel_size": parallel.pipeline_parallel_size,
            "enforce_eager": bool(getattr(model, "enforce_eager", True))}


CALIBRATION_SETTINGS = ("dtype", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "enforce_eager")


def settings_tag(settings: dict) -> str:
    """The part of a step-cost table's name (engine_key) its engine settings make: the dtype, the tensor and
    pipeline sizes, and '-compiled' for an engine that does not run the model eagerly."""
    return (f"{settings['dtype']}-tp{settings['tensor_parallel_size']}-pp{settings['pipeline_parallel_size']}"
            f"{'' if settings['enforce_eager'] else '-compiled'}")


def calibration_options(settings: dict) -> list[str]:
    """`rest-lab calibrate-vllm` options (CALIBRATION_SETTINGS) that measure an engine with these settings."""
    options = []
    if settings.get("dtype", "auto") != "auto":
        options += ["--dtype", str(settings["dtype"])]
    for name in CALIBRATION_SETTINGS[1:4]:
        if settings.get(name) is not None:
            options += ["--" + name.replace("_", "-"), str(settings[name])]
    if not settings.get("enforce_eager", True):
        options.append("--no-enforce-eager")
    return options


def engine_key(vllm_config: Any) -> str:
    """Names the step-cost table: the model, device, dtype, parallelism, vLLM's version, whether Intel's OpenMP is
    preloaded (it changes a CPU step's cost), whether the engine compiles the model (CUDA graphs or torch.compile:
    not run eagerly) and this machine."""
    import vllm

    from rest_core.serving.config import rest_lab_model_name

    device = getattr(vllm_config.device_config, "device_type", "cpu")
    settings = settings_tag(engine_settings(vllm_config))
    return (f"{rest_lab_model_name(vllm_config.model_config.model)}-{device}-{settings}"
            f"-vllm{vllm.__version__}{'-iomp' if 'libiomp5' in os.environ.get('LD_PRELOAD', '') else ''}"
            f"-{machine_key()}")
