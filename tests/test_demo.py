"""The README's first command, as a newcomer sees it: ``python -m eagertp.demo``
in a fresh interpreter prints the demo's header first and its verdict last, and
nothing on stderr (no warning from torch, gloo or eagertp that the user did not
cause). Small options, so that it takes seconds; the sizes still fuse."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def _run_demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # This checkout's eagertp, installed or not; no warning filters from the caller's shell.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "eagertp.demo", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )


def test_demo_output_is_header_to_verdict_with_nothing_on_stderr():
    # Default batch, seq and dim: the smallest demo sizes the size rule lets fuse.
    done = _run_demo("--layers", "1", "--steps", "1", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("eagertp demo: 2 ranks (gloo, cpu)"), done.stdout
    assert lines[-1].startswith("fused ops in the last step: 4 all_gather_matmul"), done.stdout
    assert lines[-1].endswith(")") and "losses match plain eager: yes" in lines[-1], done.stdout
    # Spawned on one host: the step times come with how to read them.
    assert lines[-2].startswith("(a few steps on one host") and "train_step.py" in lines[-2], done.stdout


def test_demo_without_sequence_parallel_fuses_every_all_reduce():
    # Plain TP: 6 all-reduces per block and step (2 forward, 4 backward), all fused.
    done = _run_demo("--no-sequence-parallel", "--layers", "1", "--steps", "1", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("eagertp demo: 2 ranks (gloo, cpu)"), done.stdout
    assert lines[-1].startswith("fused ops in the last step: 6 matmul_all_reduce"), done.stdout
    assert "0 unfused all-reduces" in lines[-1] and "losses match plain eager: yes" in lines[-1], done.stdout


def test_demo_help_has_nothing_on_stderr():
    done = _run_demo("--help", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: python -m eagertp.demo"), done.stdout
