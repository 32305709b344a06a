"""serve/builder.py build_server, the one way servers are assembled: a model folder served as it
is says it will not switch; a followed registry's promotions and rollbacks switch the version
served, through HTTP; `flywheel serve` takes one of the two."""

import httpx
import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.loop.cycle import CycleError
from flywheel.models import TinySpec, build_tiny_model
from flywheel.registry.registry import Registry
from flywheel.serve.builder import NothingToServe, ServerConfig, build_server

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
SPEC = TinySpec(hidden=32, layers=1, heads=2, ffn=64, max_positions=256)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("builder")
    return build_tiny_model(root / "a", SPEC), build_tiny_model(root / "b", TinySpec(**{**SPEC.__dict__, "seed": 1}))


def test_a_model_folder_is_served_as_it_is_and_says_it_will_not_switch(folders):
    said = []
    server = build_server(ServerConfig(model=folders[0], version="fixed"), log=said.append).start()
    try:
        health = httpx.get(server.url.removesuffix("/v1") + "/health").json()
        assert health["version"] == "fixed" and server.switch_now() is False
        assert any("will not switch versions" in m for m in said), said
    finally:
        server.close()


def test_a_followed_registry_switches_on_promotion_and_rollback(folders, tmp_path):
    with Registry(tmp_path / "registry") as registry:
        first = registry.register(folders[0])
        registry.promote(first.id)
        said = []
        server = build_server(ServerConfig(follow=registry, follow_poll_s=60), log=said.append).start()
        health = server.url.removesuffix("/v1") + "/health"
        try:
            assert httpx.get(health).json()["version"] == first.id
            assert any("switches it" in m for m in said), said
            second = registry.register(folders[1], parent=first.id)
            registry.promote(second.id)
            assert server.switch_now() and httpx.get(health).json()["version"] == second.id
            registry.rollback()
            assert server.switch_now() and httpx.get(health).json()["version"] == first.id
        finally:
            server.close()


def test_a_registry_with_nothing_in_production_is_refused_naming_it(tmp_path):
    with Registry(tmp_path / "registry") as registry, pytest.raises(NothingToServe, match="no production version"):
        build_server(ServerConfig(follow=registry))
    with pytest.raises(ValueError, match="one of the three"):
        build_server(ServerConfig())


def test_flywheel_serve_takes_a_model_or_follow(tmp_path):
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--model DIR" in result.output and "--follow" in result.output


def test_the_loops_server_refuses_an_empty_registry_with_the_commands_that_fix_it(tmp_path):
    from flywheel.config import validate
    from flywheel.loop.cycle import LoopStores
    from flywheel.loop.loop_config import LoopConfig
    from flywheel.serve.builder import serve_loop

    with LoopStores(validate({"data_dir": str(tmp_path)}, LoopConfig)) as fw, \
            pytest.raises(CycleError, match="flywheel registry register DIR"):
        serve_loop(fw)
