"""The strategy's rules a layout must pass before it is priced (:func:`layout_rule`), each refusal in the field's
words: divisibility of heads, widths, layers, sequence and batch; experts over the grid; the pipeline's micro-batches;
recomputation that has nothing to recompute; the memory choices that cannot go together (:mod:`.memory_choices`).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_seqpar.pipeline_parallel.schedules import V_SHAPED, least_microbatches, splits_backward
from lightning_seqpar.plan.pricing.cost import Hardware
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.pricing.memory_choices import memory_choice_rule


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending: the sizes a dimension of ``n`` ranks can be split into."""
    small = [k for k in range(1, int(n ** 0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def layout_rule(record: Any, inventory: ModelInventory, s: int, global_batch: int, hardware: Hardware) -> Optional[str]:
    """The first rule ``record`` breaks, in the field's words; ``None``: none."""
    lay, dp, mbs = record.layout, record.dp, record.micro_batch
    tp, pp, vpp = lay.tp, lay.pp, lay.virtual_stages
    if tp > hardware.gpus_per_node:
        return f"tp={tp} spans nodes ({hardware.gpus_per_node} GPUs per node): its collectives need the intra-node links"
    if inventory.num_heads % tp:
        return f"heads={inventory.num_heads} not divisible by tp={tp}"
    if inventory.num_kv_heads % tp:
        return f"kv_heads={inventory.num_kv_heads} not divisible by tp={tp}"
    experts = inventory.experts
    ffn = inventory.ffn_hidden_size if experts is None else experts.shared_ffn  # experts are whole on each rank
    if ffn % tp:
        return f"{'shared expert ' if experts else ''}ffn={ffn} not divisible by tp={tp}"
    if experts is None and lay.ep != 1:
        return f"ep={lay.ep} without experts"
    if experts is not None and experts.num_experts % lay.ep:
        return f"experts={experts.num_experts} not divisible by ep={lay.ep}"
    cp = lay.cp
    if (tp * cp * dp) % lay.ep:
        return (f"ep={lay.ep} does not divide tp·cp·dp={tp * cp * dp} (the expert grid folds over the dense "
                f"one)")
    etp = getattr(record, "expert_tp", 1)
    if etp > 1:
        if experts is None:
            return f"expert_tp={etp} without experts"
        if experts.expert_ffn % etp:
            return f"expert width={experts.expert_ffn} not divisible by expert_tp={etp}"
        if (tp * cp * dp) % (lay.ep * etp):
            return (f"ep·expert_tp={lay.ep}·{etp} does not divide tp·cp·dp={tp * cp * dp} (the expert grid folds "
                    f"over the dense one)")
        if lay.zero:
            return f"zero=1 with expert_tp={etp} (the strategy refuses it: ranges of a tensor split twice)"
    if cp > 1 and s % (2 * cp * tp):
        return (f"seq_len={s} not divisible by 2·cp·tp={2 * cp * tp} (context parallelism cuts the sequence into 2·cp "
                f"chunks for load balance, each split over tp)")
    if cp > 1 and lay.cp_comm == "all_to_all" and (inventory.num_heads // tp % cp or inventory.num_kv_heads // tp % cp):
        return (f"heads={inventory.num_heads}/kv_heads={inventory.num_kv_heads} per tensor-parallel rank not divisible "
                f"by cp={cp} (all-to-all context parallelism scatters heads)")
    if s % tp:
        return f"seq_len={s} not divisible by tp={tp} (sequence parallelism splits the sequence)"
    if lay.recompute == "selective" and cp > 1:
        return "selective recomputation has nothing to recompute under cp (blockwise attention keeps no s² tensor)"
    if lay.recompute == "selective" and not inventory.eager_attention:
        return "selective recomputation has nothing to recompute in fused attention (sdpa keeps no s² tensor)"
    if pp > 1 and splits_backward(lay.schedule) and not any(e.deferred for e in inventory.entries):
        return (f"schedule={lay.schedule} with no trained weight to defer to W (the split layers' weights are "
                f"frozen), so W fills no bubble")
    choice = memory_choice_rule(lay.recompute, lay.recompute_modules, lay.offload, cp, inventory.eager_attention,
                                inventory.experts is not None)
    if choice is not None:
        return choice
    if inventory.num_layers % (pp * vpp):
        return f"layers={inventory.num_layers} not divisible by pp·vpp={pp * vpp}"
    if global_batch % (dp * mbs):
        return f"global_batch={global_batch} not divisible by dp·micro_batch={dp * mbs}"
    m = global_batch // (dp * mbs)
    record.layout = lay = lay.replace(num_microbatches=m)
    if pp > 1 and m < pp:
        return f"micro-batches={m} < pp={pp}: stages would idle"
    if pp > 1 and m < least_microbatches(lay.schedule, pp):
        return f"micro-batches={m} < 2·pp={2 * pp}: {lay.schedule}'s warm-up sends 2·pp through rank 0's first chunk"
    if vpp > 1 and m % pp and lay.schedule not in V_SHAPED:
        return f"micro-batches={m} not divisible by pp={pp} (the interleaved schedule)"
    return None
