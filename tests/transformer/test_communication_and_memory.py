"""Deterministic figures of one rewritten layer: collectives, bytes moved, bytes saved for backward.

Korthikanti et al. 2022 §4.2.2: TP needs 2 all-reduces in a layer's forward; TP+SP replaces them with
2 all-gathers + 2 reduce-scatters of the same total bytes, and divides by t the activations that TP
leaves replicated (10·sbh of Eq. 2, 16-bit activations and 1-byte masks).
"""

import pytest
import torch

from lightning_seqpar.models.gpt import Block, GPTConfig
from lightning_seqpar.models.parallel_gpt import parallel_gpt_block
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.rewriting import RewriteContext
from lightning_seqpar.transformer.residual import cast_residual_stream
from lightning_seqpar.memory.cuda_autocast import cuda_autocast_rules
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

S, B, H, A = 16, 2, 32, 4  # s, b, h, a
F = 3 * H  # FFN width: f/t never equals h, so saved shapes tell the regions apart


def _layer(rank, sequence_parallel, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(0)
    group = ParallelGroup(torch.distributed.group.WORLD)
    ctx = RewriteContext(group, sequence_parallel, RNGTracker.for_tensor_parallel(0, rank), True)
    block = parallel_gpt_block(Block(GPTConfig(n_embd=H, n_head=A, block_size=S, dropout=dropout, ffn_hidden_size=F)), ctx).to(dtype)
    torch.manual_seed(1)
    x = torch.randn(S, B, H, dtype=dtype)
    x = group.split(x) if ctx.sp else x  # [s/t, b, h] or [s, b, h]
    x = x.clone().requires_grad_(True)
    return group, block, x


def _count(rank, world_size):
    out = {}
    for sp in (True, False):
        group, block, x = _layer(rank, sp)
        group.log = CommunicationLog()
        y = block(x)
        fwd = {k: group.log.count(k) for k in ("all_reduce", "all_gather", "reduce_scatter")}
        fwd_bytes = group.log.bytes_moved()
        group.log.clear()
        y.sum().backward()
        bwd = {k: group.log.count(k) for k in ("all_reduce", "all_gather", "reduce_scatter")}
        out[sp] = fwd, fwd_bytes, bwd, group.log.bytes_moved()
    return out


def _measure(rank, world_size):
    return _count(rank, world_size), _saved_bytes(rank, world_size)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda t: f"tp{t}")
def measured(request):
    return request.param, run_distributed(_measure, request.param)[0]


@pytest.fixture
def counts(measured):
    return measured[0], measured[1][0]


def test_forward_collectives_per_layer(counts):
    _, c = counts
    assert c[True][0] == {"all_reduce": 0, "all_gather": 2, "reduce_scatter": 2}  # g before QKV/fc1, ḡ after proj/fc2
    assert c[False][0] == {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0}  # f̄ after proj/fc2


def test_forward_bytes_equal_with_and_without_sequence_parallelism(counts):
    t, c = counts
    sbh_bytes = S * B * H * 4  # float32
    assert c[True][1] == c[False][1] == 2 * 2 * (t - 1) * sbh_bytes // t


def test_backward_collectives_per_layer(counts):
    t, c = counts
    # TP: f's all-reduce behind each column-parallel linear.
    assert c[False][2] == {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0}
    # SP: ḡ's all-gather (2), g's reduce-scatter (2), and the re-gather of the saved input shard (2, §4.2.2).
    assert c[True][2] == {"all_reduce": 0, "all_gather": 4, "reduce_scatter": 2}
    sbh_bytes = S * B * H * 4
    regather = 2 * (t - 1) * sbh_bytes // t
    assert c[True][3] == c[False][3] + regather


def _saved_bytes(rank, world_size):
    """Bytes each saved tensor keeps (storages counted once), grouped by region."""
    out = {}
    for sp in (True, False):
        group, block, x = _layer(rank, sp, dtype=torch.bfloat16, dropout=0.1)
        block.train()
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        seen, regions = set(), {"sequence_parallel_terms": 0, "tensor_parallel_terms": 0, "other": 0}
        s_local = x.shape[0]

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                seen.add(ptr)
                nbytes = t.untyped_storage().nbytes()
                if tuple(t.shape) == (s_local, B, H):
                    regions["sequence_parallel_terms"] += nbytes  # LN inputs, linear inputs, hidden masks
                elif t.shape[-1] == 1 or tuple(t.shape) == (S, S):
                    regions["other"] += nbytes  # LN mean/rstd, the causal mask: not in the paper's count
                else:
                    regions["tensor_parallel_terms"] += nbytes  # head- and feature-sharded activations
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(x)
        out[sp] = regions
    return out


@pytest.fixture
def saved(measured):
    return measured[0], measured[1][1]


def test_sequence_parallel_divides_the_replicated_activations_by_t(saved):
    t, m = saved
    sbh = S * B * H
    # Eq. 2's replicated 10·sbh (2 LN inputs, 2 linear inputs at 2 bytes; 2 dropout masks at 1 byte) ...
    assert m[False]["sequence_parallel_terms"] == 10 * sbh
    # ... becomes 10·sbh/t under SP (Eq. 4), measured on the rewritten layer.
    assert m[True]["sequence_parallel_terms"] * t == m[False]["sequence_parallel_terms"]


def test_tensor_parallel_activations_unchanged_by_sequence_parallelism(saved):
    t, m = saved
    sbh = S * B * H
    # Eq. 2's 24·sbh/t + 5as²b/t, with the MLP width f general: (8 + 4f/h)·sbh/t (Megatron-Core's form).
    expected = (8 * sbh + 4 * S * B * F) // t + 5 * A * S * S * B // t
    assert m[True]["tensor_parallel_terms"] == m[False]["tensor_parallel_terms"] == expected


def _autocast_bytes(rank, world_size):
    """Bytes moved by one layer's forward and backward (float32 parameters and input) with and without CPU bfloat16
    autocast, as Lightning's ``bf16-mixed`` runs it; and, under autocast, the bytes kept of the replicated regions."""
    out = {}
    for sp in (True, False):
        moved = {}
        for autocast in (False, True):
            group, block, x = _layer(rank, sp)
            group.log = CommunicationLog()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = block(x)
            forward = group.log.bytes_moved()
            y.float().sum().backward()
            moved[autocast] = forward, group.log.bytes_moved() - forward
        out[sp] = moved
    return out, {cast: _kept_under_autocast(rank, cast) for cast in (False, True)}


def _kept_under_autocast(rank, cast_residual):
    group, block, x = _layer(rank, True, dropout=0.1)
    block.train()
    if cast_residual:
        cast_residual_stream([block])
    x = x.detach().clone().requires_grad_(True)
    seen, kept = set(), 0

    def pack(t):
        nonlocal kept
        ptr = t.untyped_storage().data_ptr()
        if tuple(t.shape) == tuple(x.shape) and ptr not in seen:  # the input too: the first norm keeps it
            seen.add(ptr)
            kept += t.untyped_storage().nbytes()
        return t

    with cuda_autocast_rules(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    return kept


def test_sixteen_bit_collectives_under_autocast():
    """Under autocast the layer's collectives carry bfloat16: half the bytes of float32, forward and backward, with
    and without SP (the all-gather before each column-parallel linear sends what its matmul would cast anyway)."""
    t = 2
    moved, kept = run_distributed(_autocast_bytes, t)[0]
    for sp in (True, False):
        assert moved[sp][True][0] * 2 == moved[sp][False][0] > 0, (sp, moved[sp])
        assert moved[sp][True][1] * 2 == moved[sp][False][1] > 0, (sp, moved[sp])
    # Kept for backward in the replicated regions under SP: the 2 LayerNorm inputs stay float32 (autocast runs
    # norms and the residual stream in float32), the 2 column-parallel linear inputs are 16-bit, the 2 dropout
    # masks 1 byte: (2·4 + 2·2 + 2·1)·sbh/t, where float32 linear inputs would give 18·sbh/t.
    assert kept[False] == 14 * S * B * H // t
    # With the residual stream cast to 16 bits (low_precision_residual) the norm inputs are 2 bytes too: Eq. 4's
    # 10·sbh/t at 2-byte activations, and the layer's output stays 16-bit (the row-parallel bias is added in 16 bits).
    assert kept[True] == 10 * S * B * H // t
