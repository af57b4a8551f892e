"""REST drafting for a served model (vLLM): rest_core.vllm.RestProposer is the engine's side of it.

drafter  per request the best chain of REST Lab's draft tree over its stores; request states that follow the batch
load     the measured step cost T(B, D) and the batch's draft plan (how many tokens each chain gets, or none)
config   the stores and settings a server opens, from environment variables
engine   what the drafter reads from vLLM's objects (the running requests' ids, the step-cost key)
calibrate  measuring T(B, D) on this machine (`rest-lab calibrate-vllm`)
launch   REST Lab's commands that run vLLM in .venv-vllm (`rest-lab serve`, the vLLM benchmark, ...)

The vLLM benchmark itself (`python -m rest_core bench --engine vllm`) is with the others, in rest_core.bench
(vllm_bench, vllm_report).
"""
