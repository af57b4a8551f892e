"""rest_base, the package under engine and stores: the native build's key and clean-up, the machine facts."""
from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from rest_base import machine, native_build
from rest_base.calibration import CalibrationFile
from rest_base.native_policy import NATIVE, PYTHON, NativePolicy
from rest_core import machine as engine_machine

SOURCE = 'extern "C" int rest_lab_answer() { return %d; }\n'


def _needs_compiler():
    try:
        native_build.compiler()
    except OSError:
        pytest.skip("no C++ compiler here")


def test_a_library_is_kept_under_cpu_compiler_and_source_not_under_the_thread_count(monkeypatch, tmp_path):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE % 1)
    threads = torch.get_num_threads()
    here = native_build.library_path(source, "answer")
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # a thread count changes no machine code
        assert native_build.library_path(source, "answer") == here
    finally:
        torch.set_num_threads(threads)
    with monkeypatch.context() as m:
        m.setattr(native_build, "cpu_key", lambda: "another-cpu")  # another CPU or instruction set
        assert native_build.library_path(source, "answer") != here
    with monkeypatch.context() as m:
        m.setattr(native_build, "compiler_tag", lambda: "/usr/bin/g++-99")  # another compiler
        assert native_build.library_path(source, "answer") != here
    source.write_text(SOURCE % 2)  # another source
    assert native_build.library_path(source, "answer").name.split("-")[1] == here.name.split("-")[1]
    assert native_build.library_path(source, "answer") != here


def test_building_a_library_removes_the_stems_older_ones_but_the_newest_few(monkeypatch, tmp_path):
    _needs_compiler()
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True)
    older = [folder / f"answer-0123456789-{i:010x}.so" for i in range(4)] + [folder / "answer-0123456789-missing.so"]
    others = [folder / "answer-wide-0123456789-abcdef0123.so",  # another stem that begins like this one
              folder / "other-0123456789-abcdef0123.so", folder / "answer-notes.txt"]
    for age, path in enumerate(older + others):
        path.write_bytes(b"")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))  # older[0] the newest of them
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE % 1)
    first = native_build.build(source, "answer", [[]])
    assert ctypes.CDLL(str(first)).rest_lab_answer() == 1
    kept = older[:native_build.KEEP - 1]
    assert [p.exists() for p in older] == [p in kept for p in older] and all(p.exists() for p in others)
    source.write_text(SOURCE % 2)  # a changed source: built again, the first build kept as the one before
    second = native_build.build(source, "answer", [[]])
    assert second != first and second.exists() and first.exists() and not older[native_build.KEEP - 2].exists()
    assert ctypes.CDLL(str(second)).rest_lab_answer() == 2
    assert native_build.build(source, "answer", [[]], find_compiler=lambda: pytest.fail("compiled again")) == second


def test_the_compiler_tag_is_the_file_it_runs(monkeypatch):
    _needs_compiler()
    name = native_build.compiler()
    assert native_build.compiler_tag() == os.path.realpath(shutil.which(name))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(native_build.shutil, "which", lambda name: None)
    assert native_build.compiler_tag() == "none"
    with pytest.raises(OSError, match="no C\\+\\+ compiler"):
        native_build.compiler()


def test_one_cpuinfo_reader_serves_the_engine_and_the_build(monkeypatch):
    fields = {"model name": "AMD EPYC", "vendor_id": "AuthenticAMD", "cpu family": "25", "model": "1",
              "flags": "fpu avx2 avx512f"}
    monkeypatch.setattr(machine, "cpuinfo_fields", lambda: dict(fields))
    info = engine_machine.cpu_info()
    assert (info["cpu"], info["cpu_vendor"], info["cpu_family"], info["cpu_features"]) == \
        ("AMD EPYC", "AuthenticAMD", "25/1", ["avx2", "avx512f"])
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    key = machine.cpu_key()
    fields["model"] = "17"  # Zen 4 behind the same name: another build
    assert machine.cpu_key() != key
    fields["model"], fields["flags"] = "1", "fpu avx2"  # another instruction set: another build
    assert machine.cpu_key() != key


def test_a_calibration_reads_back_only_under_its_version_and_facts(monkeypatch, tmp_path):
    monkeypatch.setenv("REST_LAB_CACHE", str(tmp_path))
    made = CalibrationFile("kernels", "org/model", "abc123", 2, {"rows": (1, 2), "native": "src1"})
    assert made.path == tmp_path / "kernels" / "org_model-abc123.json" and made.read() is None
    made.write({"times": {"1": 0.5}})
    data = made.read()
    assert data["times"] == {"1": 0.5} and data["rows"] == [1, 2] and "measured_at" in data
    assert [p.name for p in made.path.parent.iterdir()] == [made.path.name]  # no temporary file left
    for other in (CalibrationFile("kernels", "org/model", "abc123", 3, made.made_with),  # another method
                  CalibrationFile("kernels", "org/model", "abc123", 2, {"rows": (1, 2), "native": "src2"}),
                  CalibrationFile("kernels", "org/model", "abc123", 2, {"rows": (1, 2, 4), "native": "src1"})):
        assert other.read() is None, other
    assert CalibrationFile("kernels", "org/model", "def456", 2, made.made_with).read() is None  # another machine
    for text in ("{not json", "[1, 2]", ""):
        made.path.write_text(text)
        assert made.read() is None
    made.path.parent.chmod(0o500)  # a cache that cannot be written: skipped, nothing raised
    try:
        made.write({"times": {}})
    finally:
        made.path.parent.chmod(0o700)


def test_a_python_policy_never_asks_for_the_library():
    asked = []
    lib = object()
    assert NATIVE.library(lambda: asked.append(1) or lib) is lib and asked == [1]
    assert PYTHON.library(lambda: asked.append(2) or lib) is None and asked == [1]
    assert NativePolicy(on=False) == PYTHON and NativePolicy() == NATIVE
