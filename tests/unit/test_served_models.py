"""ServedModels: a model loads once however many requests ask for it meanwhile, requests for
loaded models are answered while another loads, a failed load reaches every waiter and the
next request tries again, and the least recently used model is closed past the bound."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from flywheel.errors import OpenAIError
from flywheel.serve.served_models import ServedModels


class FakeService(SimpleNamespace):
    def __init__(self, name: str):
        super().__init__(name=name, closed=threading.Event(), adapter=None)
        self.scheduler = SimpleNamespace(close=self.closed.set)


def served(max_loaded: int = 2):
    models = ServedModels(SimpleNamespace(name="base", trace_sink=None, scheduler=object()),
                          lambda tenant, name: None if name == "missing" else Path(f"/models/{name}"),
                          max_loaded=max_loaded)
    gates = {"slow": threading.Event()}
    calls: list[str] = []

    def load(tenant: str, name: str):
        calls.append(name)
        if name in gates:
            gates[name].wait(10)
        if name == "broken" and calls.count("broken") == 1:
            raise RuntimeError("weights unreadable")
        return ServedModels._load(models, tenant, name) if name == "missing" else FakeService(name)

    models._load = load
    return models, gates, calls


def test_one_load_serves_every_request_and_loaded_models_answer_meanwhile():
    models, gates, calls = served()
    fast = models.get("t", "fast")
    got: list = []
    waiters = [threading.Thread(target=lambda: got.append(models.get("t", "slow"))) for _ in range(3)]
    for w in waiters:
        w.start()
    while calls.count("slow") == 0:
        threading.Event().wait(0.01)
    assert models.get("t", "fast") is fast  # not held up by the load in progress
    gates["slow"].set()
    for w in waiters:
        w.join(10)
    assert len(got) == 3 and len({id(s) for s in got}) == 1 and calls.count("slow") == 1


def test_a_failed_load_reaches_its_waiters_and_the_next_request_loads_again():
    models, _, calls = served()
    with pytest.raises(RuntimeError, match="weights unreadable"):
        models.get("t", "broken")
    assert models.get("t", "broken").name == "broken" and calls.count("broken") == 2
    with pytest.raises(OpenAIError, match="unknown model 'missing'"):
        models.get("t", "missing")


def test_models_are_per_tenant_and_the_least_recently_used_is_closed():
    models, _, _ = served(max_loaded=2)
    a, b = models.get("t1", "m"), models.get("t2", "m")
    assert a is not b
    models.get("t1", "m")  # a is the most recently used now
    c = models.get("t1", "other")
    assert b.closed.is_set() and not a.closed.is_set() and not c.closed.is_set()
    assert models.get("t1", "base") is models.base


def test_an_adapter_the_base_engine_cannot_take_gets_an_engine_of_its_own(tmp_path):
    import asyncio

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from flywheel.inference.kernels import packed_available
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.serve.core import OpenAIService

    base_dir = build_tiny_model(tmp_path / "base", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    model.name_or_path = str(base_dir.resolve())
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        tmp_path / "adapter")
    packed = packed_available(torch.zeros(1))
    base = OpenAIService(base_dir, name="base", default_max_tokens=2, packed=packed, lean=True)
    models = ServedModels(base, lambda tenant, name: tmp_path / "adapter" if name == "ft" else None)
    try:
        served = models.get("t", "ft")
        on_base = base.engine.adapters is not None
        assert (served.scheduler is base.scheduler) == on_base  # packed base: an engine of its own
        assert served.engine.adapters.names == ["t/ft"]
        reply, _ = asyncio.run(served.chat({"model": "ft", "messages": [{"role": "user", "content": "hi"}]}))
        assert reply["model"] == "ft"
        models.forget("t", "ft")
        assert served.engine.adapters is None or "t/ft" not in served.engine.adapters.names or not on_base
    finally:
        models.close()
        base.close()
