"""REST inside transformers: `model.generate(..., custom_generate=rest_generate)`.

transformers prepares the inputs, the generation config and the stopping rules as for any
`generate()` call and hands the decoding loop to `rest_generate`, which runs REST's loop
(rest_core.decode) on the same model and returns what `generate()` returns: the prompt ids
followed by the new ids, (1, prompt + new).  Greedy output is identical to `generate()`'s;
sampling (do_sample with temperature / top_k / top_p) draws from exactly the same
distribution.

    from datastores import assemble_stores
    from rest_core.hf_generate import rest_generate
    out = model.generate(input_ids, max_new_tokens=64, custom_generate=rest_generate,
                         rest_stores=assemble_stores())          # + a static store, history, ...

Extra arguments (passed to generate() by name): `rest_stores` (the draft stores; default the
request store and the model's own predictions), `rest_budget` (draft nodes per step; default 16),
`rest_hook` (called with a StepTrace per step: transformers hands no streamer to a custom_generate
callable, so this is the way to watch the steps).  One sequence at a time (batch size 1).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from datastores import RecycleStore, Store, assemble_stores
from rest_core.decode import DecodeConfig, RestDecoder
from rest_core.model import LoadedModel
from rest_core.sampling import Sampling
from rest_core.trace import StepTrace

# logits processors whose effect rest_core reproduces itself (temperature -> top-k -> top-p)
_REPRODUCED = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}


def _sampling(generation_config: Any) -> Sampling:
    """Greedy, or the config's temperature / top-k / top-p with a seed drawn from torch's global generator
    (so `torch.manual_seed` makes a sampled call repeatable, as it does for generate())."""
    if not getattr(generation_config, "do_sample", False):
        return Sampling()
    seed = int(torch.randint(0, 2**62, (1,)).item())
    return Sampling(temperature=float(generation_config.temperature or 1.0), top_k=int(generation_config.top_k or 0),
                    top_p=float(generation_config.top_p or 1.0), seed=seed)


def _eos(generation_config: Any) -> frozenset[int]:
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def _check(input_ids: torch.Tensor, logits_processor: Any, model_kwargs: dict) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"rest_generate decodes one sequence at a time; got input_ids of shape "
                         f"{tuple(input_ids.shape)}: call generate() once per prompt")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("rest_generate needs an unpadded prompt (attention_mask all ones): pass one prompt "
                         "without padding")
    others = sorted({type(p).__name__ for p in logits_processor or ()} - _REPRODUCED)
    if others:
        raise ValueError(f"rest_generate reproduces temperature, top-k and top-p only; this call also asks for "
                         f"{', '.join(others)}: drop those generation options or use plain generate()")


def rest_generate(model: torch.nn.Module, input_ids: torch.LongTensor, logits_processor: Any,
                  stopping_criteria: Any, generation_config: Any, synced_gpus: bool = False,
                  streamer: Optional[Any] = None, rest_stores: Optional[Sequence[Store]] = None,
                  rest_budget: Optional[int] = 16, rest_hook: Optional[Callable[[StepTrace], None]] = None,
                  **model_kwargs: Any) -> torch.LongTensor:
    """REST as generate()'s decoding loop; returns (1, prompt + new) token ids like generate()."""
    _check(input_ids, logits_processor, model_kwargs)
    param = next(model.parameters())
    lm = LoadedModel(model=model, tokenizer=None, name=getattr(model.config, "_name_or_path", "") or "model",
                     source="transformers", device=param.device, dtype=param.dtype, eos_ids=_eos(generation_config))
    prompt = input_ids[0].tolist()
    limit = generation_config.max_new_tokens
    if limit is None:
        limit = int(generation_config.max_length) - len(prompt)
    if limit < 1:
        return input_ids
    stores = list(rest_stores) if rest_stores is not None else assemble_stores(model=RecycleStore(lm.vocab_size))
    cfg = DecodeConfig(max_new_tokens=int(limit), sampling=_sampling(generation_config), draft_budget=rest_budget,
                       stop_at_eos=bool(lm.eos_ids))

    def on_step(trace: StepTrace) -> None:
        if streamer is not None and trace.new_tokens:
            streamer.put(torch.tensor(trace.new_tokens))
        if rest_hook is not None:
            rest_hook(trace)

    if streamer is not None:
        streamer.put(input_ids.cpu())
    hook = on_step if streamer is not None or rest_hook is not None else None
    result = RestDecoder(lm, stores=stores).generate(prompt, cfg, hook=hook)
    if streamer is not None:
        streamer.end()
    new = torch.tensor([result.tokens], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, new], dim=1)
