"""The CUDA kernels' logic on the CPU through Triton's interpreter (interpreted.py), where Triton
is installed (`make test-kernels` installs it; the CPU torch build does not bring it)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.interpret


def test_kernels_and_fused_gemma4_forward_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (make test-kernels installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-m", "tests.kernels.interpreted"], env=env, cwd=root, capture_output=True,
                         text=True, timeout=1200)
    print(run.stdout[-4000:], run.stderr[-4000:])
    assert run.returncode == 0 and run.stdout.rstrip().endswith("OK")
