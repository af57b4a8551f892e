"""REST Lab's decoding engine: retrieval-based speculative decoding on transformers.

The public face:

* `load_model` -> `LoadedModel` (the offline default SmolLM2-135M-Instruct, any hub id or folder);
* `RestDecoder(lm, stores=datastores.assemble_stores(...), budget_chooser=CostModel.for_model(lm, stores))`
  with `generate(prompt_ids, DecodeConfig(...), hook=...)` / `stream(...)`, and `plain_generate` beside it;
* `DecodeConfig`, `Sampling`, `RetrieveSettings`; `StepTrace`, what a per-step hook receives;
* `rest_step`, one step through the phases of `rest_core.phases.PHASES`.

One step, module by module: retrieve.py -> tree.py (+ cost.py sizes it) -> verify.py (the tree
forward pass and the walk) -> commit.py; decode.py runs the loop.  Around the engine:
rest_core.traces (SQLite traces, figures), rest_core.bench (the benchmark), rest_core.app
(the Gradio page's workings) and the command line (cli.py).
"""
from rest_core.cost import CostModel
from rest_core.decode import DecodeConfig, DecodeResult, PromptError, RestDecoder, plain_generate, rest_step
from rest_core.model import LoadedModel, ModelLoadError, encode_prompt, load_model
from rest_core.retrieve import RetrieveSettings
from rest_core.sampling import Sampling
from rest_core.trace import Branch, StepTrace

__all__ = [
           "Branch",
           "CostModel",
           "DecodeConfig",
           "DecodeResult",
           "LoadedModel",
           "ModelLoadError",
           "PromptError",
           "RestDecoder",
           "RetrieveSettings",
           "Sampling",
           "StepTrace",
           "encode_prompt",
           "load_model",
           "plain_generate",
           "rest_step",
]
