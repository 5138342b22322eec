"""The machines a step runs on: how many nodes, the network between them, and the bus bandwidth a
data-parallel collective reaches over them (`bus_bytes_per_s`). The catalog of networks and interconnects is
data/plan_throughput.toml (`constants`)."""

from __future__ import annotations

from typing import Any

from anatomist.errors import InputError
from anatomist.estimate.time.constants import constants
from anatomist.hardware import GPU

DEFAULT_NODES = 1


def networks() -> dict[str, dict[str, Any]]:
    """The networks between nodes that `--network` names (plan_throughput.toml's [inter_node.networks])."""
    return constants()["inter_node"]["networks"]


def default_network() -> str:
    return constants()["inter_node"]["default"]


def check_cluster(num_gpus: int, nodes: int, network: str | None) -> None:
    """Refuse a node count that does not divide the devices, or a network the catalog lacks."""
    if nodes < 1:
        raise InputError(f"--nodes must be at least 1, got {nodes}")
    if num_gpus % nodes:
        raise InputError(f"{num_gpus} GPUs cannot be split evenly over {nodes} nodes")
    if network is not None and network not in networks():
        raise InputError(f"--network: unknown network {network!r}; known: {', '.join(networks())}")


def cluster_fields(nodes: int, network: str | None) -> dict[str, Any]:
    """What a result's JSON says of the machines: nothing on one node (the output 0.x scripts read)."""
    if nodes <= 1:
        return {}
    return {"nodes": nodes, "network": network or default_network()}


def describe_network(num_gpus: int, nodes: int, network: str | None, gpu: GPU | None = None) -> str:
    """One line for the output: the network between the nodes and the bandwidth the time model gives it."""
    name = network or default_network()
    return (f"{nodes} nodes, {networks()[name]['describe']} ({name}): collectives at "
            f"{bus_bytes_per_s(num_gpus, nodes, name, gpu) / 1e9:.0f} GB/s bus bandwidth")


def intra_node_bytes_per_s(gpu: GPU | None) -> float:
    """The achieved bus bandwidth among `gpu`s of one host, by how they are joined (`GPU.interconnect`)."""
    interconnect = constants()["interconnect"]
    kind = interconnect["kinds"].get(gpu.interconnect) if gpu is not None else None
    return (kind or interconnect)["bus_gbps"] * 1e9


def bus_bytes_per_s(
    num_gpus: int, nodes: int = DEFAULT_NODES, network: str | None = None, gpu: GPU | None = None
) -> float:
    """Achieved bus bandwidth of a data-parallel collective over `num_gpus` `gpu`s on `nodes` machines.

    In one node: what the GPUs' interconnect achieves (None: the catalog's default). Across nodes NCCL runs a
    ring per NIC, so the ring's slowest hop moves at the node's network bandwidth (all its NICs) times what
    NCCL achieves of it.
    """
    intra = intra_node_bytes_per_s(gpu)
    if nodes <= 1:
        return intra
    return min(intra, node_network_bytes_per_s(num_gpus // nodes, network))


def node_network_bytes_per_s(gpus_per_node: int, network: str | None = None) -> float:
    """What NCCL achieves of one node's network (all its NICs: one per GPU, or one per node)."""
    link = networks()[network or default_network()]
    node_gbit = link["gbit_per_gpu"] * gpus_per_node if "gbit_per_gpu" in link else link["gbit_per_node"]
    return node_gbit / 8 * 1e9 * constants()["inter_node"]["achieved"]
