"""Run vLLM from REST Lab's own command line: `rest-lab serve`, `rest-lab calibrate-vllm`, `bench --engine vllm`.

vLLM lives in its own environment (.venv-vllm at the checkout's root, made by `scripts/setup.sh --vllm`; or the
Python named by REST_LAB_VLLM_PYTHON), so these commands start that environment's Python with the settings every
vLLM run of REST Lab gets (VLLM_DEFAULTS, each unless set): VLLM_CPU_KVCACHE_SPACE=2 (GB: without it a CPU
worker grew to most of a 24 GB machine); VLLM_CPU_NUM_OF_RESERVED_CPU=0 (vLLM's CPU backend otherwise keeps one
core per worker off the model for its scheduler and front-end processes: half of a 2-core machine, where the
model then ran 1.2x slower at batch 1 and 1.3-1.5x at batch 16, docs/bench/vllm-zen5-cores.md; on a large
machine one core is a small share either way); and, where the environment has it and LD_PRELOAD is not set,
Intel's OpenMP runtime preloaded (vLLM's CPU backend asks for it; REST_LAB_IOMP=0 leaves it out).
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from datastores.common import DatastoreError
from rest_base.files import read_json, safe_file_name

ROOT = Path(__file__).resolve().parents[2]
# the environment every vLLM run of REST Lab starts with, where not set (see the module's docstring)
VLLM_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
LAUNCHED_ON = "REST_LAB_LAUNCHED_ON"  # the machine key of the process that asked for a step-cost table


def with_vllm_defaults(env):
    """`env` (a dict, or os.environ) with each of VLLM_DEFAULTS set where it was not."""
    for name, value in VLLM_DEFAULTS.items():
        env.setdefault(name, value)
    return env


def set_vllm_defaults() -> None:
    """VLLM_DEFAULTS in this process's environment, where not set (a vLLM entry point started directly)."""
    with_vllm_defaults(os.environ)


def vllm_python() -> Path:
    """The Python of the vLLM environment (a clear error naming the set-up command when there is none)."""
    path = Path(os.environ.get("REST_LAB_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not path.is_file():
        raise DatastoreError(f"no vLLM environment at {path}: create it with `scripts/setup.sh --vllm` (a few "
                             f"minutes, once), or point REST_LAB_VLLM_PYTHON at a Python that has vLLM 0.32")
    return path


def vllm_env(python: Path) -> dict[str, str]:
    """The environment a vLLM run starts with (see the module docstring)."""
    env = with_vllm_defaults(dict(os.environ))
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and not env.get("LD_PRELOAD") and env.get("REST_LAB_IOMP", "1") != "0":
        env["LD_PRELOAD"] = str(iomp)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_module(module: str, args: Sequence[str], env: Optional[dict[str, str]] = None) -> int:
    """`python -m module args...` in the vLLM environment (with `env` added to it); its exit status."""
    python = vllm_python()
    return subprocess.call([str(python), "-m", module, *args], env={**vllm_env(python), **(env or {})},
                           cwd=str(ROOT))


def served_model(model: str | None) -> str:
    """The folder or hub id vLLM loads: REST Lab's default model as its converted fp32 folder."""
    from rest_core.model import resolve_source

    return resolve_source(model)[1]


SETTING_OPTIONS = {"--dtype": "dtype", "--tensor-parallel-size": "tensor_parallel_size", "-tp": "tensor_parallel_size",
                   "--pipeline-parallel-size": "pipeline_parallel_size", "-pp": "pipeline_parallel_size",
                   "--max-model-len": "max_model_len"}


def engine_options(vllm_args: Sequence[str]) -> dict:
    """The settings a step's cost depends on (serving.engine.engine_settings), as vLLM's options give them: the
    dtype, the parallelism, the context length and whether the model runs eagerly (vLLM's defaults otherwise)."""
    found = {"dtype": "auto", "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_model_len": None,
             "enforce_eager": False}
    args = list(vllm_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == "--enforce-eager":
            found["enforce_eager"] = value.lower() not in ("false", "0") if eq else True
        elif name in SETTING_OPTIONS:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            key = SETTING_OPTIONS[name]
            if key == "dtype":
                found[key] = value
            else:
                try:
                    found[key] = int(value)
                except ValueError:
                    raise ValueError(f"{name} needs a number, got {value!r}") from None
    return found


def has_curve(model: str, settings: dict) -> bool:
    """Whether a step cost was measured for this model with these engine settings (engine_options), on this
    machine as vLLM runs on it: a table named with this machine's key (a CPU machine, where both environments have
    the same torch and vLLM uses every core, VLLM_DEFAULTS), or one measured at this machine's asking (its
    `launched_on`: a GPU machine's vLLM environment has a torch of its own, so its tables' keys differ); any dtype
    where the settings leave it to vLLM ('auto').  A table measured on another machine, or with vLLM keeping a core
    off the model (the key counts the worker's threads), is not this one's: the proposer would refuse it."""
    from rest_core.machine import machine_key
    from rest_core.serving.config import rest_lab_model_name
    from rest_core.serving.engine import settings_tag
    from rest_core.serving.load import curve_path

    tag = settings_tag(settings)  # "auto-tp1-pp1" where the dtype is left to vLLM
    wanted = f"-{tag.partition('-')[2]}-vllm" if settings["dtype"] == "auto" else f"-{tag}-vllm"
    here = machine_key()
    for path in curve_path("x").parent.glob(f"vllm-{safe_file_name(rest_lab_model_name(model))}-*.json"):
        if wanted not in path.name:
            continue
        if path.stem.endswith(f"-{here}"):
            return True
        about = read_json(path)  # named for another key: read only to see who asked for it
        if isinstance(about, dict) and about.get("launched_on") == here:
            return True
    return False


def ensure_step_cost(folder: str, settings: dict) -> int:
    """REST's proposer plans with the step cost measured for the served model and these engine settings, and refuses
    to start without one: measure it now (`rest-lab calibrate-vllm`) where none was; the exit status (0: there is
    one)."""
    if has_curve(folder, settings):
        return 0
    from rest_core.machine import machine_key
    from rest_core.serving.engine import calibration_options

    print("Measuring vLLM's step cost on this machine (once per model, engine settings and machine)...", flush=True)
    return run_module("rest_core.serving.calibrate", [folder, *calibration_options(settings)],
                      {LAUNCHED_ON: machine_key()})


def serve(model: str | None, drafts: int, vllm_args: Sequence[str]) -> int:
    """vLLM's OpenAI-compatible server for `model` with REST drafting; the step cost measured first if needed."""
    python = vllm_python()  # no vLLM environment: said before the model is fetched or converted
    folder = served_model(model)
    status = ensure_step_cost(folder, engine_options(vllm_args))
    if status:
        return status
    spec = ('{"method": "custom_class", "model": "rest_core.vllm.RestProposer", '
            f'"num_speculative_tokens": {drafts}}}')
    # the OpenAI server's own module: vllm-cpu 0.32.0's `vllm` command stops at once, looking up the version of a
    # distribution named "vllm" where it is installed as "vllm-cpu"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--speculative-config",
               spec, *vllm_args]
    print("Starting: " + " ".join(command[2:]), flush=True)
    os.execve(str(python), command, vllm_env(python))
    return 0  # not reached
