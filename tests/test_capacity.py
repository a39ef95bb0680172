"""Whether the cluster can host the run's workers: counted from the nodes' resources, before the workers
are created and while the run goes (a node lost shows on the progress line)."""

from __future__ import annotations

import io
import json

import pytest
import ray
from ray.cluster_utils import Cluster

from executor import capacity
from executor.progress import Progress
from executor.tasks import InputError


def test_places_are_counted_per_node_by_the_scarcest_resource():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0, "sandbox_slot": 2.0, "gpu_box": 1.0}},
        {"Alive": True, "Resources": {"CPU": 2.0, "sandbox_slot": 3.0}},
        {"Alive": False, "Resources": {"sandbox_slot": 100.0}},  # a dead node hosts nothing
    ]
    assert capacity.placeable({"sandbox_slot": 1}, nodes) == 5
    assert capacity.placeable({"sandbox_slot": 1, "gpu_box": 0.5}, nodes) == 2
    assert capacity.placeable({"sandbox_slot": 1.5}, nodes) == 3
    assert capacity.placeable({"other": 1}, nodes) == 0
    assert capacity.fits({}, {}) > 0  # a worker asking nothing fits anywhere


@pytest.mark.integration
def test_a_request_no_node_offers_is_refused_and_a_lost_node_is_said():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    node = cluster.add_node(num_cpus=1, resources={"sandbox_slot": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        capacity.check({"sandbox_slot": 1}, workers=2)  # two places for two workers: nothing to say
        with pytest.raises(InputError) as refused:
            capacity.check({"sandbox_slot": 1, "gpu_box": 1}, workers=1, wait_s=0)
        line = str(refused.value)
        assert line.startswith("concurrency.worker_resources {gpu_box: 1, sandbox_slot: 1}: no node")
        assert "2 alive node(s) offer" in line and "{sandbox_slot: 2}" in line and "\n" not in line

        watch = capacity.Watch({"sandbox_slot": 1}, workers=2)
        watch.tick(force=True)
        assert watch.note is None
        cluster.remove_node(node)
        cluster.wait_for_nodes()
        watch.tick(force=True)
        assert watch.note == "the cluster now hosts 0 of 2 workers asking {sandbox_slot: 1}"

        stream = io.StringIO()
        progress = Progress("r", 4, stream=stream, live=False)
        progress.cluster = watch.note
        progress.tick(force=True)
        assert json.loads(stream.getvalue().splitlines()[-1])["cluster"] == watch.note
    finally:
        ray.shutdown()
        cluster.shutdown()
