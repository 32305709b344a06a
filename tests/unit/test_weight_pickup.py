"""Zero-copy weight pickup: an engine bound to a leased shared-memory buffer decodes exactly
the published weights (dense kernels on the buffer itself, packed ones reordered from it),
never a mix of versions, and never writes into the shared buffer."""

import pytest
import torch

from flywheel.inference import LocalEngine, SamplingParams
from flywheel.inference import kernels
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.orchestrate.pool import rollout_transport
from flywheel.weights import SharedMemoryTransport

PROMPTS = ["12+34=", "a longer prompt"]
PARAMS = SamplingParams(n=2, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # qwen2: q/k/v biases; grouped-query attention
    return build_tiny_model(tmp_path_factory.mktemp("pickup"),
                            TinySpec(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=7))


@pytest.fixture(params=["dense", "packed"])
def kind(request):
    return request.param


@pytest.fixture
def segment(model_dir):
    """(learner model, transport as `flywheel rl` makes it for one worker, a reader slot)."""
    learner, _ = load(model_dir)
    writer = rollout_transport(learner, 1)
    reader = SharedMemoryTransport.attach(writer.name).reader()
    yield learner, writer, reader
    reader.transport.close()
    writer.close()


def _engine(model_dir, kind):
    return LocalEngine.from_path(str(model_dir), seed=0, version=-1, packed=kind == "packed")


def _weights(learner, seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter (what a learner step would publish)."""
    g = torch.Generator().manual_seed(seed)
    return {k: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for k, p in learner.named_parameters()}


def _outputs(engine, seed=0):
    engine.generator.manual_seed(seed)
    return engine.generate([engine.encode(p) for p in PROMPTS], PARAMS)


def _same(a, b):
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            assert x.token_ids == y.token_ids and x.version == y.version
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def _in_buffer(t: torch.Tensor, transport, b: int) -> bool:
    views = transport.views[b].values()
    lo = min(v.data_ptr() for v in views)
    hi = max(v.data_ptr() + v.numel() * v.element_size() for v in views)
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def _leased(reader) -> int:
    return reader.transport.leases()[reader.slot]


def test_a_zero_copy_pickup_decodes_exactly_the_published_weights(model_dir, segment, kind):
    learner, writer, reader = segment
    engine, reference = _engine(model_dir, kind), _engine(model_dir, kind)
    for v in (1, 2, 3):  # the buffers rotate: every pickup rebinds to another one
        w = _weights(learner, v)
        writer.publish(w, v)
        rebuilt = engine.kernel_rebuild_s
        assert engine.receive(reader) and engine.version == v
        assert engine.kernel_rebuild_s > rebuilt  # the kernels rebuilt, and timed
        rebuilt = engine.kernel_rebuild_s
        assert not engine.receive(reader)  # nothing newer
        assert engine.kernel_rebuild_s == rebuilt
        reference.update_weights(w, v)
        _same(_outputs(engine), _outputs(reference))
        b = _leased(reader)
        # no private copy of any parameter is left: each is a view of the leased buffer
        assert all(_in_buffer(p, reader.transport, b) for p in engine.model.parameters())
        layer = engine.runner._collect()[0]
        if kind == "dense":  # the fused q/k/v and gate/up weights too: the kernels read the buffer
            assert all(_in_buffer(t, reader.transport, b) for t in (*layer["qkv"], layer["gate_up"][0]))


def test_a_segment_without_fused_groups_still_decodes_right(model_dir, kind):
    learner, _ = load(model_dir)
    writer = SharedMemoryTransport.create(dict(learner.named_parameters()), readers=1)  # no `adjacent`
    try:
        reader = SharedMemoryTransport.attach(writer.name).reader()
        engine, reference = _engine(model_dir, kind), _engine(model_dir, kind)
        w = _weights(learner, 4)
        writer.publish(w, 1)
        engine.receive(reader)
        reference.update_weights(w, 1)
        _same(_outputs(engine), _outputs(reference))
        if kind == "dense":  # q/k/v are not back to back there: fused by a copy
            assert not _in_buffer(engine.runner._collect()[0]["qkv"][0], reader.transport, _leased(reader))
        reader.transport.close()
    finally:
        writer.close()


def test_a_bound_engine_keeps_its_version_while_the_learner_publishes_on(model_dir, segment, kind):
    learner, writer, reader = segment
    engine, reference = _engine(model_dir, kind), _engine(model_dir, kind)
    w1 = _weights(learner, 1)
    writer.publish(w1, 1)
    engine.receive(reader)
    reference.update_weights(w1, 1)
    before = _outputs(engine)
    leased = _leased(reader)
    for v in range(2, 8):  # more versions than buffers: the writer cycles through the free ones
        writer.publish(_weights(learner, v), v)
        assert _leased(reader) == leased
    _same(_outputs(engine), before)  # the leased buffer was never written: still all of version 1
    _same(before, _outputs(reference))
    assert engine.receive(reader) and engine.version == 7
    reference.update_weights(_weights(learner, 7), 7)
    _same(_outputs(engine), _outputs(reference))


def test_updates_after_a_zero_copy_pickup_never_write_the_shared_buffer(model_dir, segment, kind):
    learner, writer, reader = segment
    engine, reference = _engine(model_dir, kind), _engine(model_dir, kind)
    writer.publish(_weights(learner, 1), 1)
    engine.receive(reader)
    b = _leased(reader)
    held = {k: t.clone() for k, t in reader.transport.views[b].items()}
    w = _weights(learner, 2)
    engine.update_weights(w, 5)
    reference.update_weights(w, 5)
    assert all(torch.equal(reader.transport.views[b][k], t) for k, t in held.items())
    assert reader.transport.leases() == {}  # the engine owns its weights again: lease released
    assert not any(_in_buffer(p, reader.transport, b) for p in engine.model.parameters())
    _same(_outputs(engine), _outputs(reference))
    writer.publish(_weights(learner, 3), 6)  # and a copy pickup after that is a plain copy
    assert engine.receive(reader.transport) and reader.transport.leases() == {}
    reference.update_weights(_weights(learner, 3), 6)
    _same(_outputs(engine), _outputs(reference))


def test_a_failed_kernel_rebuild_leaves_no_kernels_rather_than_a_mix(model_dir, segment, monkeypatch):
    learner, writer, reader = segment
    engine = _engine(model_dir, "packed")
    writer.publish(_weights(learner, 1), 1)
    engine.receive(reader)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("no room for the packed copies")

    monkeypatch.setattr("flywheel.inference.decoder.packed_kernels", out_of_memory)
    writer.publish(_weights(learner, 2), 2)
    with pytest.raises(MemoryError):
        engine.receive(reader)
    with pytest.raises(RuntimeError, match="no kernels"):
        _outputs(engine)


def test_adjacent_view_spans_back_to_back_tensors_only():
    flat = torch.arange(24.0)
    a, b, c = flat[:8].view(2, 4), flat[8:16].view(2, 4), flat[20:24].view(1, 4)
    view = kernels.adjacent_view([a, b])
    assert view.shape == (4, 4) and view.data_ptr() == a.data_ptr() and torch.equal(view, flat[:16].view(4, 4))
    assert kernels.adjacent_view([a, c]) is None  # a gap
    assert kernels.adjacent_view([b, a]) is None  # out of order
    assert kernels.adjacent_view([a, torch.arange(8.0, 16.0).view(2, 4)]) is None  # another storage
    assert kernels.adjacent_view([flat[:8], flat[8:16].view(2, 4)]) is None  # trailing dims differ


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # per-head q/k norms; no biases
def test_other_families_pick_up_zero_copy_too(arch, kind, tmp_path):
    model_dir = build_tiny_model(tmp_path / arch, TinySpec(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128,
                                                           arch=arch))
    learner, _ = load(model_dir)
    writer = rollout_transport(learner, 1)
    try:
        reader = SharedMemoryTransport.attach(writer.name).reader()
        engine, reference = _engine(model_dir, kind), _engine(model_dir, kind)
        assert engine.is_lean
        w = _weights(learner, 1)
        writer.publish(w, 1)
        engine.receive(reader)
        reference.update_weights(w, 1)
        _same(_outputs(engine), _outputs(reference))
        assert all(_in_buffer(p, reader.transport, _leased(reader)) for p in engine.model.parameters())
        reader.transport.close()
    finally:
        writer.close()
