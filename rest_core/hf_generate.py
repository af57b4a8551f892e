"""REST inside transformers: `model.generate(..., custom_generate=rest_generate)`.

transformers prepares the inputs, the generation config and the stopping rules as for any
`generate()` call and hands the decoding loop to `rest_generate`, which runs REST's loop
(rest_core.decode) on the same model and returns what `generate()` returns: the prompt ids
followed by the new ids, (1, prompt + new), or with `return_dict_in_generate` a
`GenerateDecoderOnlyOutput` holding them.  Greedy output is identical to `generate()`'s;
sampling (do_sample with temperature / top_k / top_p) draws from exactly the same
distribution.  Stopping criteria (max_time, StopStringCriteria, your own) are checked after
every committed token, as generate() checks them.  (`stop_strings=` needs the Hub-folder form:
transformers drops the tokenizer it needs before it calls a custom_generate callable; with the
callable, pass `stopping_criteria=[StopStringCriteria(tokenizer, strings)]`.)

    from rest_core.hf_generate import rest_generate
    out = model.generate(input_ids, max_new_tokens=64, custom_generate=rest_generate,
                         datastore=store)           # a Store, or a list of them used as they are

Extra arguments (passed to generate() by name): `datastore` (a static store, drafted from beside
the request store and the model's own predictions; or a list of stores, used as they are -- a dense
store among them, datastores.DenseStore built with this model, drafts from the neighbours of the hidden
state this loop keeps from every pass; default: request store and model's predictions), `rest_budget`
(draft nodes per step; default 16),
`rest_hook` (called with a StepTrace per step), `rest_streamer` (a streamer: transformers hands
`streamer=` only to the Hub-folder form, custom_generate/generate.py, which passes it on as this).
One sequence at a time (batch size 1).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from datastores import RecycleStore, Store, assemble_stores
from rest_core.decode import DecodeConfig, RestDecoder, StopCheck
from rest_core.model import LoadedModel
from rest_core.sampling import Sampling
from rest_core.trace import StepTrace

# logits processors whose effect rest_core reproduces itself (temperature -> top-k -> top-p)
_REPRODUCED = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_PER_TOKEN_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


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


def _check(input_ids: torch.Tensor, logits_processor: Any, generation_config: Any, model_kwargs: dict) -> None:
    if int(getattr(generation_config, "num_beams", 1) or 1) > 1:
        raise ValueError(f"rest_generate does not do beam search (num_beams={generation_config.num_beams}): "
                         "use num_beams=1, or plain generate() for beam search")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"rest_generate decodes one sequence at a time; got input_ids of shape "
                         f"{tuple(input_ids.shape)}: call generate() once per prompt")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("rest_generate needs an unpadded prompt (attention_mask all ones): pass one prompt "
                         "without padding")
    if getattr(generation_config, "prompt_lookup_num_tokens", None):
        raise ValueError("rest_generate already drafts from the prompt (the request store): drop "
                         "prompt_lookup_num_tokens")
    asked = [name for name in _PER_TOKEN_OUTPUTS if getattr(generation_config, name, False)]
    if asked:
        raise ValueError(f"rest_generate returns the sequences only; {', '.join(asked)} asks for per-token tensors "
                         "it does not keep: drop it, or use plain generate()")
    others = sorted({type(p).__name__ for p in logits_processor or ()} - _REPRODUCED)
    if others:
        raise ValueError(f"rest_generate reproduces temperature, top-k and top-p only; this call also asks for "
                         f"{', '.join(others)}: drop those generation options or use plain generate()")


def _stores(lm: LoadedModel, datastore: Any) -> list[Store]:
    if datastore is None:
        return assemble_stores(model=RecycleStore(lm.vocab_size))
    if isinstance(datastore, Store):
        return assemble_stores(static=datastore, model=RecycleStore(lm.vocab_size))
    if isinstance(datastore, (list, tuple)) and all(isinstance(s, Store) for s in datastore):
        return list(datastore)
    raise ValueError(f"datastore must be a store (e.g. datastores.open_static_store(folder, tokenizer)) or a list "
                     f"of stores; got {type(datastore).__name__}")


def _stop_check(stopping_criteria: Any, device: torch.device) -> Optional[StopCheck]:
    """generate()'s stopping criteria, asked after every committed token as generate() asks them."""
    if not stopping_criteria:
        return None

    def check(sequence: Sequence[int], new: int) -> Optional[int]:
        ids = torch.tensor([list(sequence)], device=device)
        start = len(sequence) - new
        for end in range(start + 1, len(sequence) + 1):
            if bool(stopping_criteria(ids[:, :end], None).any()):
                return end - start
        return None

    return check


def rest_generate(model: torch.nn.Module, input_ids: torch.LongTensor, logits_processor: Any,
                  stopping_criteria: Any, generation_config: Any, synced_gpus: bool = False,
                  datastore: Any = None, rest_budget: Optional[int] = 16,
                  rest_hook: Optional[Callable[[StepTrace], None]] = None, rest_streamer: Optional[Any] = None,
                  **model_kwargs: Any) -> Any:
    """REST as generate()'s decoding loop; returns (1, prompt + new) token ids like generate()."""
    _check(input_ids, logits_processor, generation_config, model_kwargs)
    param = next(model.parameters())
    lm = LoadedModel(model=model, tokenizer=None, name=getattr(model.config, "_name_or_path", "") or "model",
                     source="transformers", device=param.device, dtype=param.dtype, eos_ids=_eos(generation_config))
    prompt = input_ids[0].tolist()
    limit = generation_config.max_new_tokens
    if limit is None:
        limit = int(generation_config.max_length) - len(prompt)
    stores = _stores(lm, datastore)
    cfg = DecodeConfig(max_new_tokens=max(int(limit), 1), sampling=_sampling(generation_config),
                       draft_budget=rest_budget, stop_at_eos=bool(lm.eos_ids))
    streamer = rest_streamer

    def on_step(trace: StepTrace) -> None:
        if streamer is not None and trace.new_tokens:
            streamer.put(torch.tensor(trace.new_tokens))
        if rest_hook is not None:
            rest_hook(trace)

    if streamer is not None:
        streamer.put(input_ids.cpu())
    new_ids: list[int] = []
    if limit >= 1:
        hook = on_step if streamer is not None or rest_hook is not None else None
        new_ids = RestDecoder(lm, stores=stores).generate(prompt, cfg, hook=hook,
                                                          stop_check=_stop_check(stopping_criteria, lm.device)).tokens
    if streamer is not None:
        streamer.end()
    sequences = torch.cat([input_ids, torch.tensor([new_ids], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    if getattr(generation_config, "return_dict_in_generate", False):
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
