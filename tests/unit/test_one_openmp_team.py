"""A served engine keeps its process's parallel torch work on one thread (flywheel/threads.py):
building the engine and registering a LoRA adapter on the main thread start no OpenMP team
there, and serving rows of the base and of the adapter through the batch scheduler leaves
exactly one team, the scheduler thread's. With two teams libgomp cuts its workers' spin-wait
and every parallel op pays a wake-up.

A team shows as native threads that are not Python threads (libgomp's workers: a team of N
threads adds N - 1). Measured in a fresh interpreter: pytest's own process has run torch on its
main thread long before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.models import TinySpec, build_tiny_model

peft = pytest.importorskip("peft")

CHILD = r"""
import json, os, sys, threading
import torch
torch.set_num_threads(2)
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.inference.scheduler import BatchScheduler

def workers():  # native threads that are not Python threads
    python = {t.native_id for t in threading.enumerate()}
    return sum(1 for t in os.listdir("/proc/self/task") if int(t) not in python)

model, adapter, packed = sys.argv[1], sys.argv[2], sys.argv[3] == "packed"
before = workers()
engine = LocalEngine.from_path(model, packed=packed)
engine.adapters.register("a", adapter)
built = workers() - before
scheduler = BatchScheduler(engine, "v0")
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
futures = [scheduler.submit(list(range(3, 40)), params, adapter=name) for name in ("a", None, "a")]
for f in futures:
    f.result(timeout=120)
served = workers() - before
scheduler.close()
print(json.dumps({"built": built, "served": served}))
"""


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("omp")
    # hidden 256: the packed kernels' size, and weights large enough for torch's parallel ops
    base = build_tiny_model(root / "base", TinySpec(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512))
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"], init_lora_weights=False)
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), cfg).save_pretrained(root / "adapter")
    return base, root / "adapter"


@pytest.mark.slow  # two fresh interpreters that load torch and a model (~15 s): make test-all
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.parametrize("kernels", ["packed", "dense"])
def test_a_served_engine_runs_its_torch_work_in_one_openmp_team(model_and_adapter, kernels):
    base, adapter = model_and_adapter
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(base), str(adapter), kernels], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts == {"built": 0, "served": 1}, counts  # no team on the main thread; the scheduler's: 2 - 1 workers
