"""The README's curl and SDK examples run against a live server."""

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_readme_curl_examples(server):
    script = blocks("bash")[1].replace("http://127.0.0.1:8000", server.url)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "data: [DONE]" in out.stdout and '"history_tokens"' in out.stdout


def test_readme_sdk_example(server, capsys):
    code = blocks("python")[0].replace("http://127.0.0.1:8000", server.url)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
