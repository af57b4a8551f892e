"""REST Lab's decoding loop as a Hub `custom_generate` folder.

A model repository (or any folder) holding this `custom_generate/` folder lets anyone run REST
through transformers' own generate():

    model.generate(**inputs, custom_generate="<repo or folder>", trust_remote_code=True,
                   datastore=store, max_new_tokens=64, streamer=streamer)

transformers calls `generate(model=..., **every argument of the generate() call)`; this hands the
loop to `rest_core.hf_generate.rest_generate` (pip package `rest-lab`, named in requirements.txt
beside this file), passing on the streamer and the stop strings, which transformers gives only to
this form.
"""
from typing import Any


def generate(model: Any, streamer: Any = None, **generate_arguments: Any) -> Any:
    try:
        from rest_core.hf_generate import rest_generate
    except ImportError as err:
        raise ImportError("this custom_generate runs REST Lab's decoding loop, from the rest-lab package: "
                          "install it (pip install rest-lab, or pip install . in a REST Lab checkout)") from err
    from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
    from transformers.generation.utils import GenerationMixin

    stop_strings, tokenizer = generate_arguments.pop("stop_strings", None), generate_arguments.pop("tokenizer", None)
    if stop_strings:  # made into a stopping criterion here: transformers drops the tokenizer before the loop
        if tokenizer is None:
            raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer=... to generate()")
        criteria = StoppingCriteriaList(generate_arguments.pop("stopping_criteria", None) or [])
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        criteria.append(StopStringCriteria(tokenizer, strings))
        generate_arguments["stopping_criteria"] = criteria
    # GenerationMixin.generate, not model.generate: a model loaded with this folder's code has its
    # generate() replaced by this function
    return GenerationMixin.generate(model, custom_generate=rest_generate, rest_streamer=streamer,
                                    **generate_arguments)
