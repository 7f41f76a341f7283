"""The weight-sync rendezvous address: configured, else the node's address as Ray registered it."""

from __future__ import annotations

from streamrl.weight_sync.group import rendezvous_address


def test_configured_address_wins():
    assert rendezvous_address("10.1.2.3") == "10.1.2.3"


def test_outside_ray_it_is_loopback(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert rendezvous_address(None) == "127.0.0.1"


def test_inside_ray_it_is_the_nodes_address(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.9.8.7")
    assert rendezvous_address(None) == "10.9.8.7"
