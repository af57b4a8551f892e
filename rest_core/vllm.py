"""REST drafting inside vLLM: `speculative_config={"method": "custom_class", "model": "rest_core.vllm.RestProposer",
"num_speculative_tokens": k}`.

Every engine step the proposer drafts, for each running request, the best chain of REST Lab's draft tree over
the model's stores and the model's own predictions, read from its logits, and for chat requests whose other drafts are
weak the dense store, queried with the model's hidden state read from its pass (rest_core.serving.drafter), as many
tokens of it as the step cost says the whole batch can afford (rest_core.serving.load): none at all when drafting
would not pay, counting the proposer's own time.  Stores and settings come from environment variables
(rest_core.serving.config); the step cost is measured once per machine with `rest-lab calibrate-vllm MODEL` and
refreshed from every step the engine runs (rest_core.serving.live).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from rest_core.serving.config import open_drafter, plain_sampling
from rest_core.serving.engine import (
    calibration_options,
    calling_runner,
    calling_scheduler,
    engine_key,
    engine_settings,
    remaining_tokens,
    running_request_ids,
    sample_plainly_without_drafts,
    waiting_requests,
    watch_logits,
    watch_states,
)

__all__ = ["NoDraftProposer", "RestProposer"]
log = logging.getLogger("rest_core.serving")
SCHEDULER_TRIES = 16  # propose() calls that look for the scheduler among their callers (warm-up passes need not)


def sample_plainly(runner: Any, stats: dict) -> None:
    """Have the runner sample steps without drafts on vLLM's plain path (serving.engine.sample_plainly_without_drafts,
    counted in stats), unless REST_LAB_PLAIN_SAMPLING=0; nothing where no runner was found."""
    if runner is not None and plain_sampling():
        sample_plainly_without_drafts(runner, stats)


class RestProposer:
    """vLLM's custom proposer for REST Lab's drafts (built by vLLM with its VllmConfig)."""

    def __init__(self, vllm_config: Any):
        from transformers import AutoTokenizer

        self.runner = calling_runner()
        model = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
        self.drafter = open_drafter(model.model, tokenizer,
                                    max_drafts=vllm_config.speculative_config.num_speculative_tokens,
                                    max_len=model.max_model_len, engine_key=engine_key(vllm_config),
                                    vocab_size=model.get_vocab_size(),
                                    calibrate_with=calibration_options(engine_settings(vllm_config)),
                                    layers=getattr(model.hf_config, "num_hidden_layers", None),
                                    eager=bool(getattr(model, "enforce_eager", False)))
        self.drafter.warm_up()
        self.scheduler: Any = None  # the engine core's scheduler, looked for in the first steps (not built yet)
        self._scheduler_tries = SCHEDULER_TRIES

    def load_model(self, model: Any = None, *args, **kwargs) -> None:
        """Nothing to load (REST drafts without a model of its own); the runner that calls this is the one to read,
        and the served model's logits teach the drafter the model's own predictions."""
        if self.runner is None:
            self.runner = calling_runner()
        sample_plainly(self.runner, self.drafter.stats)
        table = self.drafter.predictions
        if table is not None and not watch_logits(model, table.successors_k, self.drafter.predicted,
                                                  wanted=self.drafter.wants_predictions):
            self.drafter.predictions = None  # nothing would teach it
        dense = self.drafter.dense
        if dense is not None and not watch_states(model, dense.state_layer, self.runner, self.drafter.see_states,
                                                  keep=1 + self.drafter.max_drafts, wanted=self.drafter.wants_states):
            log.warning("REST Lab: drafting without the dense store: the served model's hidden state %d cannot be "
                        "read (no decoder layers at .model.layers)", dense.state_layer)
            self.drafter.dense = None

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None) -> list[list[int]]:
        if self.runner is None:
            raise RuntimeError("REST Lab's proposer cannot see the running requests' ids in this vLLM version "
                               "(no model runner among its callers); use vLLM 0.32 (scripts/setup.sh --vllm)")
        if self.scheduler is None and self._scheduler_tries:
            self._scheduler_tries -= 1
            self.scheduler = calling_scheduler()
        ids = running_request_ids(self.runner, len(sampled_token_ids))
        waiting = waiting_requests(self.scheduler) if self.scheduler is not None else None
        return self.drafter.step(ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
                                 remaining_tokens(self.runner, ids), waiting)


class NoDraftProposer:
    """A custom proposer that never drafts: what vLLM's drafting path costs by itself (the floor under any proposer
    that finds drafting would not pay), measured by the benchmark's `empty` method; its steps, none with drafts, are
    sampled as REST's proposer has such steps sampled (serving.engine.sample_plainly_without_drafts)."""

    def __init__(self, vllm_config: Any):
        from rest_core.serving.config import propose_log

        self.report = propose_log()  # with REST_LAB_PROPOSE_LOG: its steps and the collector's time, as REST's
        self.stats = {"steps": 0}
        if self.report is not None:
            self.report.watch(self.stats)
        self.runner = calling_runner()

    def load_model(self, *args, **kwargs) -> None:
        """Steps without drafts are sampled as REST's proposer has them sampled (sample_plainly_without_drafts)."""
        sample_plainly(self.runner, self.stats)

    def propose(self, sampled_token_ids: list[list[int]], *args: Any, **kwargs: Any) -> list[list[int]]:
        self.stats["steps"] += 1
        if self.report is not None:
            self.report.tick(self.stats)
        return [[] for _ in sampled_token_ids]
