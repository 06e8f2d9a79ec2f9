"""The CUDA kernels' logic on the CPU through Triton's interpreter (interpreted.py), where Triton
is installed (`make test-kernels` installs it, and bitsandbytes for the NF4 kernels; the CPU torch build
brings neither)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.interpret


def interpret(module: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-m", module], env=env, cwd=root, capture_output=True, text=True,
                         timeout=1200)
    print(run.stdout[-4000:], run.stderr[-4000:])
    assert run.returncode == 0 and run.stdout.rstrip().endswith("OK")


def test_kernels_and_fused_gemma4_forward_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    interpret("tests.kernels.interpreted")


def test_nf4_kernels_against_bitsandbytes_and_the_fused_gemma3_forward_on_them():
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (make test-kernels installs it)")
    interpret("tests.kernels.interpreted_nf4")
