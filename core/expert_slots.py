"""Expert slots: the placement as the flat slot lists that serving engines load.

SGLang (`physical_to_logical_map`) and TensorRT-LLM (`initial_global_assignments`) both describe
a layer's placement as one list of E + R expert ids, slot s living on EP rank s // S with
S = (E + R) / ranks slots per rank. Device d's experts (sorted) fill slots d*S .. d*S + S - 1.
A device that hosts fewer than S distinct experts (a policy that gave one device two copies of
an expert) repeats its own experts in the spare slots, so the list stays a valid layout with the
same experts per device; a device with more than S cannot be expressed and is an error.
"""
from __future__ import annotations


def slots_per_device(num_experts: int, redundant: int, devices: int) -> int:
    slots = num_experts + redundant
    if slots % devices:
        raise ValueError(f"{slots} slots do not divide over {devices} devices")
    return slots // devices


def layer_slots(devices: list, per_device: int) -> list:
    """[D * S] expert ids for one layer from `devices[d]` = experts hosted by device d."""
    out = []
    for d, experts in enumerate(devices):
        experts = sorted(int(e) for e in experts)
        if not experts or len(experts) > per_device:
            raise ValueError(f"device {d} hosts {len(experts)} experts; each must host 1..{per_device}")
        out.extend(experts[i % len(experts)] for i in range(per_device))
    return out


def placement_slots(placement: dict, num_experts: int, redundant: int) -> list:
    """[MoE layers][E + R] expert per slot, from a `placement.json` document."""
    layers = placement["layers"]
    per_device = slots_per_device(num_experts, redundant, len(layers[0]["devices"]))
    table = [layer_slots(layer["devices"], per_device) for layer in layers]
    for l, slots in enumerate(table):
        missing = set(range(num_experts)) - set(slots)
        if missing:
            raise ValueError(f"MoE layer {l} places no slot for experts {sorted(missing)[:5]}")
    return table

