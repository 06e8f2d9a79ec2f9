"""What an HTTP front end pays to start. It talks to the engine process and never runs the
model, so importing it (and what a front-end process takes from the engine process's module)
leaves the model runner and transformers' model code unloaded. Loading the tokenizer runs with
the garbage collector paused, and turns it back on after."""

import gc
import subprocess
import sys

from engine.model.source import collector_paused


def test_the_front_end_does_not_import_the_model_runner():
    code = ("import sys, service.app, service.frontends, engine.process; "
            "print(sorted(m for m in sys.modules if m.startswith(('engine.runner', 'engine.core.engine', "
            "'engine.model.fused', 'engine.model.hf_adapter', 'transformers.models'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_engine_is_still_importable_from_the_package():
    from engine import Engine
    from engine.core.engine import Engine as Defined

    assert Engine is Defined


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
