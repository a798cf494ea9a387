"""How long one collective takes over one process group: the communication half of the step-time model.

A group is known by its shape (`Group`): how many of its ranks share a node, over how many nodes. The
shape, not the world, sets the bandwidth. NCCL runs all-gather, reduce-scatter and all-reduce as rings
(its tuning model, NVIDIA/nccl src/graph/tuning.cc `ncclTopoTuneModel`): a rank moves `(g-1)/g` of the
gathered bytes for an all-gather or reduce-scatter and `2(g-1)/g` for an all-reduce (nccl-tests
doc/PERFORMANCE.md, "bus bandwidth"), at the group's bus bandwidth, after NCCL's latency: a base per
call and one hardware latency per ring step, inside a node over NVLink or PCIe, across nodes over the
network (`ring_latency_s`). Inside a node the bus bandwidth is the GPU's link (NVLink, else PCIe).
Across nodes a ring leaves each node once per channel, and NCCL gives every local rank of the group a
channel on its own NIC: the node's share of the fabric that the group's local ranks own, `r x` the
rate NCCL reaches per NIC (fabrics.yaml `bus_gbs_per_gpu`, below the line rate), bounds it. The node's
other ranks run their own groups of the same kind at the same moment (every expert-data-parallel group
reduces at once), so they keep their NICs.

An all-to-all has no ring: each rank sends `(g-1)/g` of its bytes, `(g-r)/g` of them through its own
share of the NICs and `(r-1)/g` over the node's links, both at once; the node's links at the share of
their line rate NCCL reaches (`A2A_LINK_SHARE`), the NICs at the fabric's rate, which is already NCCL's.

Where the user calibrated their cluster (`dskit calibrate`, dskit/calibrate/calibration.py), each
shape's measured latency and bus bandwidth replace the catalog's for that shape; a ring across more (or
fewer) nodes than were measured takes the measured ring with as many ranks per node across the nearest
number of nodes (a ring's bus bandwidth does not depend on its length), its latency scaled by NCCL's
model of the two rings (the steps inside nodes and across them). `Rate.source` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from dskit.calibrate.calibration import EXCHANGE, OPS, Calibration
from dskit.catalog import GPU, Fabric

__all__ = [
    "A2A_LINK_SHARE",
    "OPS",
    "Group",
    "Links",
    "Rate",
    "groups",
    "moved_share",
    "ring_latency_s",
    "ring_steps",
]

#: NCCL's ring latency model, protocol Simple (the one large messages take), microseconds: a base per
#: call, plus one hardware latency per ring step, by the link the step crosses (tuning.cc `baseLat`,
#: `hwLat`: NVLink 3.4, PCIe 5.7, the network 9.6). At 256 ranks on 32 nodes an all-gather's 224 steps
#: inside nodes are 0.76 ms of its 1.07 ms.
NCCL_RING_BASE_US = 8.4
NCCL_STEP_US = {"nvlink": 3.4, "pcie": 5.7, "net": 9.6}
NCCL_NET_STEP_US = NCCL_STEP_US["net"]
US = 1e-6
GB = 1e9
#: the share of a GPU's link inside a node (gpus.yaml `interconnect_gbs`, the line rate: the ceiling)
#: that NCCL's all-to-all reaches on large messages: "450GB/s is the line rate. With the protocol
#: overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as
#: BusBw when running non-allreduce operations" (NCCL's maintainer, NVIDIA/nccl-tests issue #212).
#: Across nodes an all-to-all reaches one NIC's rate per rank ("Alltoall cannot aggregate the bandwidth
#: of multiple NICs"; "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC",
#: nccl-tests issue #267): the fabric's `bus_gbs_per_gpu`, which takes no share on top
A2A_LINK_SHARE = 0.8

#: where a rate came from, as --explain prints it
MEASURED = "measured on this cluster (dskit calibrate)"
CATALOG = "catalog (gpus.yaml link, fabrics.yaml NICs)"


@dataclass(frozen=True)
class Group:
    """The shape of one kind of process group: `ranks_per_node` of its ranks on each of `nodes` nodes."""

    ranks_per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def key(self) -> str:
        """How a calibration file names the shape: `8x4` is 8 ranks on each of 4 nodes."""
        return f"{self.ranks_per_node}x{self.nodes}"

    def describe(self) -> str:
        if not self.spans_nodes:
            return f"{self.size} ranks inside a node"
        return f"{self.size} ranks, {self.ranks_per_node} on each of {self.nodes} nodes"


def groups(world: int, per_node: int, ep_size: int) -> dict[str, Group]:
    """The groups a plan forms (AutoEP's layout): `dense` is every rank (ZeRO shards the non-expert
    weights over it); `ep`, consecutive ranks holding different experts; `expert_dp`, the ranks holding
    the same experts, strided by ep over the world. EP divides the ranks per node or is a multiple of
    them (search.ep_tiles_nodes), so each kind of group has one shape."""
    per_node = min(per_node, world)
    if per_node % ep_size and ep_size % per_node:
        raise ValueError(f"EP {ep_size} straddles nodes of {per_node} ranks unevenly")
    nodes = world // per_node
    if ep_size <= per_node:
        ep = Group(ep_size, 1)
        edp = Group(per_node // ep_size, nodes)
    else:
        ep = Group(per_node, ep_size // per_node)
        edp = Group(1, world // ep_size)
    return {"dense": Group(per_node, nodes), "ep": ep, "expert_dp": edp}


def moved_share(op: str, size: int) -> float:
    """Bytes a rank sends per byte of the collective's whole tensor (NCCL's bus-bandwidth factor)."""
    ring = (size - 1) / size
    return 2 * ring if op == "all_reduce" else ring


def ring_steps(op: str, g: Group) -> tuple[int, int]:
    """(every step, the steps that cross nodes) of a ring (tuning.cc `nsteps`, `nInterSteps`)."""
    per_pass = (g.size - 1, g.nodes - 1)
    return (2 * per_pass[0], 2 * per_pass[1]) if op == "all_reduce" else per_pass


def ring_latency_s(op: str, g: Group, intra_kind: str | None) -> float:
    """NCCL's latency for one call of `op` over groups shaped `g` whose steps inside a node cross
    `intra_kind` links (nvlink, pcie; None: pcie's). An all-to-all exchanges with every peer at once:
    one step, over the network where the group spans nodes."""
    intra = NCCL_STEP_US["nvlink" if intra_kind == "nvlink" else "pcie"]
    if op == "all_to_all":
        return (NCCL_STEP_US["net"] if g.spans_nodes else intra) * US
    steps, inter = ring_steps(op, g)
    return (NCCL_RING_BASE_US + (steps - inter) * intra + inter * NCCL_STEP_US["net"]) * US


@dataclass(frozen=True)
class Rate:
    bus_gbs: float  # bytes a rank sends, per second of the transfer, in GB/s
    latency_s: float  # per call
    source: str  # MEASURED or CATALOG


@dataclass(frozen=True)
class Links:
    """The rates of one cluster: a GPU's link inside a node (and its kind, for NCCL's step latency), the
    fabric's per-GPU bus rate across nodes (None: unknown), and the user's measurements where they
    calibrated."""

    intra_gbs: float | None
    fabric_gbs: float | None
    calibration: Calibration | None = None
    intra_kind: str | None = "nvlink"

    @classmethod
    def of(cls, gpu: GPU, fabric: Fabric, calibration: Calibration | None = None) -> Links:
        """The catalog's rates for `gpu` on `fabric` (the rate NCCL reaches, not the line rate)."""
        return cls(gpu.interconnect_gbs, fabric.bus_gbs_per_gpu, calibration, gpu.interconnect_kind)

    def rate(self, op: str, g: Group) -> Rate | None:
        """The rate of `op` over groups shaped `g`, or None where nothing says (a fabric without a
        catalog rate, not calibrated)."""
        if self.calibration is not None:
            found = self.calibration.nearest(op, g.key)
            if found is not None:
                fit, at = found
                if at == g.key:
                    return Rate(fit.bus_gbs, fit.latency_s, MEASURED)
                measured = Group(*(int(x) for x in at.split("x")))
                scale = ring_latency_s(op, g, self.intra_kind) / ring_latency_s(op, measured, self.intra_kind)
                source = f"{MEASURED} on {at}, latency scaled to {g.nodes} nodes by NCCL's ring model"
                return Rate(fit.bus_gbs, fit.latency_s * scale, source)
        return self.catalog_rate(op, g)

    def exchange(self, g: Group) -> Rate | None:
        """AutoEP's dispatch-and-combine pair over groups shaped `g` as `dskit calibrate` measured it (its
        bytes are both directions': dskit/calibrate/job.py `exchange_bytes`), or None where it was not:
        the step-time model then takes the catalog's all-to-all rate and AutoEP's fitted fixed cost."""
        found = None if self.calibration is None else self.calibration.nearest(EXCHANGE, g.key)
        return None if found is None else Rate(found[0].bus_gbs, found[0].latency_s, MEASURED)

    def catalog_rate(self, op: str, g: Group) -> Rate | None:
        intra = self.intra_gbs
        if intra is not None and op == "all_to_all":
            intra *= A2A_LINK_SHARE
        latency = ring_latency_s(op, g, self.intra_kind)
        if not g.spans_nodes:
            return None if intra is None else Rate(intra, latency, CATALOG)
        if self.fabric_gbs is None or intra is None:
            return None
        if op == "all_to_all":
            # per-rank time per byte sent: the network share and the node's share run at once
            net = (g.size - g.ranks_per_node) / g.size / self.fabric_gbs
            node = (g.ranks_per_node - 1) / g.size / intra
            bus = moved_share(op, g.size) / max(net, node)
        else:
            bus = min(intra, g.ranks_per_node * self.fabric_gbs)
        return Rate(bus, latency, CATALOG)

    def seconds(self, op: str, g: Group, nbytes: float, calls: float = 1.0) -> float | None:
        """Seconds for `calls` collectives moving `nbytes` of whole tensor in all (None: rate unknown);
        a group of one rank moves nothing."""
        if g.size == 1:
            return 0.0
        r = self.rate(op, g)
        if r is None:
            return None
        return calls * r.latency_s + nbytes * moved_share(op, g.size) / (r.bus_gbs * GB)
