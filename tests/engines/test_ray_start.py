"""Ray and the node actors start in a thread while the driver sets up the run."""

import os
import sys
import threading

import pytest
from flwr.simulation.ray_transport import ray_actor

from fedavg.engines.simulation import ray_start
from fedavg.flower_compat import prestarted_actors


class Actor:
    """Stands for an actor handle; ``made`` counts the ones the pool itself created."""

    made = 0

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def options(cls, **resources):
        """Return what ``.remote()`` is called on, as a Ray actor class would."""
        class Remote:
            @staticmethod
            def remote(**kwargs):
                cls.made += 1
                return cls(f"pool-{cls.made}")
        return Remote


def test_the_pool_takes_prestarted_actors_first_and_creates_only_the_rest(monkeypatch):
    monkeypatch.setattr(ray_actor, "pool_size_from_resources", lambda resources: 3)
    Actor.made = 0
    early = [Actor("early-1"), Actor("early-2")]
    with prestarted_actors(early):
        pool = ray_actor.BasicActorPool(actor_type=Actor, client_resources={"num_cpus": 1},
                                        actor_kwargs={})
        pool.add_actors_to_pool(pool.actors_capacity)
    assert [a.name for a in pool.pool] == ["early-1", "early-2", "pool-1"]
    assert Actor.made == 1
    after = ray_actor.BasicActorPool(actor_type=Actor, client_resources={"num_cpus": 1},
                                     actor_kwargs={})
    after.add_actors_to_pool(1)  # the patch is gone: the pool creates its own again
    assert [a.name for a in after.pool] == ["pool-2"]


def _fake_start(monkeypatch, init):
    monkeypatch.setattr(ray_start, "init_ray", init)
    monkeypatch.setattr(ray_start, "node_actors", lambda resources, on_init: ["a", "b"])
    backend = {"init_args": {"num_cpus": 2}, "client_resources": {"num_cpus": 1}}
    return ray_start.RayStart(backend, "/nowhere")


def test_the_start_thread_lives_until_released_and_hands_over_the_actors(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    starting = _fake_start(monkeypatch, lambda backend, temp_dir: None).start()
    assert starting.wait() == ["a", "b"]
    # Ray's GCS and raylet get a parent-death signal when the thread that started them ends
    assert starting._thread.is_alive()
    starting.release()
    assert not starting._thread.is_alive()
    assert not any(t.name == "fedavg-ray-start" for t in threading.enumerate())


def test_an_error_while_ray_starts_is_raised_by_wait(monkeypatch):
    def init(backend, temp_dir):
        raise RuntimeError("no room for the object store")

    starting = _fake_start(monkeypatch, init).start()
    with pytest.raises(RuntimeError, match="object store"):
        starting.wait()
    starting.settle()
    starting.release()
    assert not starting._thread.is_alive()


def test_a_private_instance_gets_the_drivers_path_and_never_another_cluster(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv("PYTHONPATH", "/extra")
    ray_start.export_python_path({"init_args": {"num_cpus": 2}})
    assert "RAY_ADDRESS" not in os.environ
    parts = os.environ["PYTHONPATH"].split(os.pathsep)
    assert parts[-1] == "/extra" and parts[:len(sys.path)] == sys.path


@pytest.mark.e2e
def test_a_simulation_trains_on_the_actors_started_while_it_set_up(tmp_path, monkeypatch,
                                                                    no_leaks):
    import fedavg
    import fedavg.flower_compat as compat

    early, pooled = [], []
    create = compat.node_actors

    def node_actors(resources, on_init):
        early.extend(create(resources, on_init))
        return early

    add = ray_actor.BasicActorPool.add_actors_to_pool

    def add_actors_to_pool(self, num_actors):
        add(self, num_actors)
        pooled.extend(self.pool)

    monkeypatch.setattr(ray_start, "node_actors", node_actors)
    monkeypatch.setattr(ray_actor.BasicActorPool, "add_actors_to_pool", add_actors_to_pool)
    res = fedavg.simulate(dataset="digits", num_nodes=3, rounds=2, output=tmp_path / "run")
    assert res.accuracy > 0.5
    assert len(early) == (os.cpu_count() or 1)  # one actor per core at 1 CPU per node
    assert [a._actor_id for a in pooled] == [a._actor_id for a in early]
    assert set(res.startup_s) >= {"ray_start", "engine_start", "round1"}


def test_ray_on_loopback_is_undone_afterwards(monkeypatch):
    from ray._private import ray_constants

    from fedavg.flower_compat import LOOPBACK_VAR, ray_on_loopback

    monkeypatch.delenv(LOOPBACK_VAR, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_on_loopback():
        assert os.environ[LOOPBACK_VAR] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
        from ray._private.services import get_node_ip_address

        assert get_node_ip_address() in ("127.0.0.1", "::1")
    assert LOOPBACK_VAR not in os.environ and ray_constants.ENABLE_RAY_CLUSTER is before
