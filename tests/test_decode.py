"""Decoding with a KV cache (kernels/decode.py) against the float64 reference.

The reference gathers each sequence's cache (pages in block-table order, or the row that
cache_batch_idx names) into a contiguous tensor and calls `attention_reference` with
per-sequence key lengths. Criterion as the dense kernel's tests: error at most twice the
same-dtype PyTorch error plus a small epsilon. Cache slots past each sequence's length, and
pages no sequence uses, hold NaN: a kernel reading them would show it. On CPU the kernels run
in Triton's interpreter (fp16/fp32, tiny shapes); the `gpu` tests repeat the checks at real
sizes in bf16/fp16.
"""

import json
import math

import pytest
import torch

from baselines.reference import attention_reference, attention_same_dtype
from harness.accuracy import within_twice_the_error
from kernels import decode
from kernels.decode import choose_num_splits, flash_attn_with_kvcache
from tests.attention_checks import ABS_EPS, poisoned_allocations  # noqa: F401 (poisoned_allocations: a fixture)

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)


def make_cache(batch, capacity, kv_heads, headdim, dtype, device, seqlens, page_size=0, spare_pages=2,
               v_apart=False):
    """Random caches holding `seqlens` (a list) keys per sequence, NaN everywhere else.

    page_size 0: contiguous (batch, capacity, ...); else a pool of shuffled pages (plus
    `spare_pages` unused, NaN) and the int32 block table. `v_apart`: V is the first half of a
    pool twice as wide (NaN in the other half), so its strides are not K's."""
    if page_size:
        pages_per_seq = capacity // page_size
        num_pages = batch * pages_per_seq + spare_pages
        shape = (num_pages, page_size, kv_heads, headdim)
        block_table = torch.randperm(num_pages, device=device)[:batch * pages_per_seq]
        block_table = block_table.reshape(batch, pages_per_seq).to(torch.int32)
    else:
        shape, block_table = (batch, capacity, kv_heads, headdim), None
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    if v_apart:
        v_cache = torch.full((*shape[:-1], 2 * headdim), float("nan"), dtype=dtype, device=device)[..., :headdim]
    for b, length in enumerate(seqlens):
        for cache in (k_cache, v_cache):
            fill_slots(cache, block_table, b, 0, torch.randn(length, kv_heads, headdim, dtype=dtype, device=device))
    return k_cache, v_cache, block_table


def slots(cache, block_table, b, start, count):
    """(index tuple) of sequence b's cache rows start .. start + count - 1."""
    positions = torch.arange(start, start + count, device=cache.device)
    if block_table is None:
        return (torch.full_like(positions, b), positions)
    page_size = cache.shape[1]
    return (block_table[b].long()[positions // page_size], positions % page_size)


def fill_slots(cache, block_table, b, start, values):
    cache[slots(cache, block_table, b, start, values.shape[0])] = values


def gathered(cache, block_table, cache_batch_idx, batch):
    """(batch, capacity, kv_heads, headdim): the cache as each sequence sees it."""
    if block_table is not None:
        return cache[block_table.long()].flatten(1, 2)
    rows = torch.arange(batch, device=cache.device) if cache_batch_idx is None else cache_batch_idx.long()
    return cache[rows]


def decode_reference(q, k_cache, v_cache, seqlens_k, block_table=None, cache_batch_idx=None, **features):
    """(out64, lse64, same-dtype out) of q over each sequence's first seqlens_k[b] keys."""
    k, v = (gathered(c, block_table, cache_batch_idx, q.shape[0]) for c in (k_cache, v_cache))
    out, lse = attention_reference(q, k, v, seqlens_k=seqlens_k.cpu(), **features)
    same = []
    for b, length in enumerate(seqlens_k.tolist()):
        slopes = features.get("alibi_slopes")
        per_seq = {**features, "alibi_slopes": slopes[b] if slopes is not None and slopes.dim() == 2 else slopes}
        same.append(attention_same_dtype(q[b:b + 1], k[b:b + 1, :length], v[b:b + 1, :length], **per_seq))
    return out, lse, torch.cat(same)


def assert_matches(out, lse, ref_out, ref_lse, same):
    assert not torch.isnan(out).any(), "out has NaN"
    ok, err, yardstick = within_twice_the_error(out, ref_out, same, ABS_EPS[out.dtype])
    assert ok, f"max error {err:.3e} > 2 x same-dtype error {yardstick:.3e} + eps"
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without keys must have lse +inf"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)


def rotary_reference(x, cos, sin, positions, interleaved):
    """Float64 rotary embedding as complex multiplication: pair (a, b) -> (a + ib) e^(i theta)."""
    half = cos.shape[1]
    x64 = x.double()
    rot = x64[..., :2 * half]
    a, b = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    phase = torch.complex(cos.double()[positions], sin.double()[positions])[:, :, None, :]
    turned = torch.complex(a, b) * phase
    parts = (torch.stack((turned.real, turned.imag), -1).flatten(-2) if interleaved
             else torch.cat((turned.real, turned.imag), -1))
    return torch.cat((parts, x64[..., 2 * half:]), -1)


def rotary_tables(seqlen_ro, rotary_dim, dtype, device):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, device=device, dtype=torch.float64) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def check_decode(batch, seqlen_q, heads, kv_heads, headdim, capacity, seqlens, dtype, device, page_size=0,
                 num_splits=0, causal=False, v_apart=False, **features):
    k_cache, v_cache, block_table = make_cache(batch, capacity, kv_heads, headdim, dtype, device, seqlens,
                                               page_size, v_apart=v_apart)
    q = torch.randn(batch, seqlen_q, heads, headdim, dtype=dtype, device=device)
    lengths = torch.tensor(seqlens, dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table,
                                       causal=causal, num_splits=num_splits, return_softmax_lse=True, **features)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref_out, ref_lse, same = decode_reference(q, k_cache, v_cache, lengths, block_table, causal=causal, **features)
    assert_matches(out, lse, ref_out, ref_lse, same)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.usefixtures("poisoned_allocations")
def test_ragged_lengths_match_reference_with_gqa(heads, kv_heads, dtype, device):
    check_decode(4, 1, heads, kv_heads, 32, 80, [0, 1, 37, 80], dtype, device, num_splits=3)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.usefixtures("poisoned_allocations")
def test_paged_cache_matches_reference(page_size, device):
    check_decode(3, 1, 4, 2, 32, 64, [64, 0, 29], torch.float16, device, page_size=page_size, num_splits=2)


def record_address_layouts(monkeypatch) -> list[dict]:
    """The (PAGE_LAYOUT, SAME_KV_STRIDES) each split-kernel launch takes from here on."""
    launches = []
    real = decode._split_launcher

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({name: kwargs[name] for name in ("PAGE_LAYOUT", "SAME_KV_STRIDES")})
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(decode, "_split_launcher", Recording())
    return launches


@pytest.mark.parametrize("window_size", [(-1, -1), (1000, -1)], ids=["one run per split", "splits round robin"])
@pytest.mark.usefixtures("poisoned_allocations")
def test_paged_key_blocks_spanning_several_pages_match_the_reference(window_size, monkeypatch):
    """64-key blocks over 16-token pages (each key block gathers four pages, as on the GPU), the
    block table read one block ahead, ragged lengths, one split (a program walks all three blocks
    of the longest sequence) and two, the splits' blocks one run each (a paged cache without a
    window) or round robin (under a left window, here wider than the cache: a split's second
    block read one step of num_splits ahead), the rows' in-page offsets worked out once per
    launch."""
    from kernels import decode

    monkeypatch.setattr(decode, "INTERPRETER_CONFIG", (64, 4, 1))
    launches = record_address_layouts(monkeypatch)
    for num_splits in (1, 2):
        check_decode(3, 1, 4, 2, 32, 192, [192, 0, 77], torch.float16, "cpu", page_size=16, num_splits=num_splits,
                     window_size=window_size)
    assert launches == [{"PAGE_LAYOUT": 1, "SAME_KV_STRIDES": True}] * 2


@pytest.mark.parametrize("page_size,layout", [(16, 1), (48, 0), (64, 2), (128, 2)],
                         ids=["pages in a block", "neither divides", "a page per block", "blocks in a page"])
@pytest.mark.parametrize("v_apart", [False, True], ids=["K and V strided alike", "V strided apart"])
@pytest.mark.usefixtures("poisoned_allocations")
def test_each_page_layout_matches_the_reference(page_size, layout, v_apart, monkeypatch):
    """64-key blocks over pages that a block holds several of, that neither divides the other, that
    are one block, or that hold two blocks (the split kernel's PAGE_LAYOUT by kv_addressing), with
    V's rows at K's offsets or (V a view of a wider pool) at its own; ragged lengths, one and
    three splits one run each (no window) and round robin (a left window wider than the cache)."""
    from kernels import decode

    monkeypatch.setattr(decode, "INTERPRETER_CONFIG", (64, 4, 1))
    k_cache, v_cache, _ = make_cache(1, 384, 2, 32, torch.float16, "cpu", [1], page_size=page_size, v_apart=v_apart)
    assert decode.kv_addressing(page_size, 64, False, k_cache, v_cache) == {"PAGE_LAYOUT": layout,
                                                                         "SAME_KV_STRIDES": not v_apart}
    launches = record_address_layouts(monkeypatch)
    for window_size in ((-1, -1), (1000, -1)):
        for num_splits in (1, 3):
            check_decode(3, 1, 4, 2, 32, 384, [384, 0, 141], torch.float16, "cpu", page_size=page_size,
                         num_splits=num_splits, v_apart=v_apart, window_size=window_size)
    assert launches == [{"PAGE_LAYOUT": layout, "SAME_KV_STRIDES": not v_apart}] * 4  # the kernel ran that layout


def test_contiguous_caches_take_per_row_addresses_and_v_at_ks_offsets_when_strided_alike():
    k_cache = torch.empty(2, 64, 2, 32)
    for shallow in (False, True):
        assert decode.kv_addressing(0, 64, shallow, k_cache, k_cache.clone()) == {"PAGE_LAYOUT": 0,
                                                                                 "SAME_KV_STRIDES": True}
        assert decode.kv_addressing(0, 64, shallow, k_cache, k_cache.transpose(1, 2).contiguous().transpose(1, 2)) \
            == {"PAGE_LAYOUT": 0, "SAME_KV_STRIDES": False}


def test_paged_caches_keep_per_block_addresses_under_the_shallow_pipeline():
    pages = torch.empty(8, 16, 2, 32)
    assert decode.kv_addressing(16, 64, False, pages, pages.clone()) == {"PAGE_LAYOUT": 1, "SAME_KV_STRIDES": True}
    assert decode.kv_addressing(16, 64, True, pages, pages.clone()) == {"PAGE_LAYOUT": 0,
                                                                           "SAME_KV_STRIDES": False}


@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged"])
@pytest.mark.usefixtures("poisoned_allocations")
def test_a_window_split_many_ways_matches_the_reference(page_size):
    """A 20-key window at the end of ragged caches of up to 10 key blocks, causal, two query
    tokens, split 3 and 16 ways (16 leave some splits without any block) with the splits' blocks
    round robin (interleave_splits' rule under a window), paged and contiguous."""
    for splits in (3, 16):
        check_decode(3, 2, 4, 2, 32, 160, [160, 0, 57], torch.float16, "cpu", page_size=page_size,
                     num_splits=splits, causal=True, window_size=(20, 0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.usefixtures("poisoned_allocations")
def test_several_query_tokens_causal_aligned_to_each_sequence_end(causal, device):
    # seqlen_q 3 > a length of 2: under causal that sequence's first row sees no key (zeros, lse +inf)
    out, lse = check_decode(3, 3, 4, 2, 32, 48, [2, 48, 20], torch.float16, device, num_splits=2, causal=causal)
    if causal:
        assert torch.isinf(lse[0, :, 0]).all() and (out[0, 0] == 0).all()


@pytest.mark.usefixtures("poisoned_allocations")
def test_mqa_tokens_spanning_two_query_tiles_with_a_window(device):
    # 5 tokens x 16 q heads on one kv head: 80 packed rows, two tiles of 64; keys up to 2 ahead
    check_decode(2, 5, 16, 1, 16, 48, [48, 30], torch.float16, device, num_splits=2, window_size=(7, 2))


def test_splits_round_robin_except_on_a_paged_cache_without_a_window():
    from kernels import decode

    assert decode.interleave_splits(paged=False, window_left=-1)
    assert not decode.interleave_splits(paged=True, window_left=-1)
    assert decode.interleave_splits(paged=True, window_left=4096)


def test_splits_agree_with_one_split_to_fp32_rounding(device):
    batch, heads, kv_heads, headdim, capacity = 2, 4, 2, 32, 112
    k_cache, v_cache, _ = make_cache(batch, capacity, kv_heads, headdim, torch.float32, device, [112, 45])
    q = torch.randn(batch, 1, heads, headdim, dtype=torch.float32, device=device)
    lengths = torch.tensor([112, 45], dtype=torch.int32, device=device)
    one, lse_one = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=1,
                                           return_softmax_lse=True)
    for splits in (2, 3, 7, 16):  # 7 key blocks of 16: 16 splits leave most of them empty
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits,
                                           return_softmax_lse=True)
        torch.testing.assert_close(out, one, atol=2e-6, rtol=1e-5, msg=f"num_splits={splits}")
        torch.testing.assert_close(lse, lse_one, atol=2e-6, rtol=1e-6, msg=f"num_splits={splits}")


@pytest.mark.usefixtures("poisoned_allocations")
def test_window_softcap_alibi_match_reference(device):
    slopes = torch.rand(3, 4, device=device, dtype=torch.float32) * 0.3
    check_decode(3, 2, 4, 2, 32, 64, [64, 9, 40], torch.float16, device, num_splits=3,
                 window_size=(20, 0), softcap=5.0, alibi_slopes=slopes)


@pytest.mark.usefixtures("poisoned_allocations")
def test_cache_batch_idx_picks_cache_rows(device):
    lengths = [30, 50, 0, 12]
    k_cache, v_cache, _ = make_cache(4, 64, 2, 32, torch.float16, device, lengths)
    rows = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    seqlens = torch.tensor([lengths[r] for r in rows.tolist()], dtype=torch.int32, device=device)
    q = torch.randn(3, 1, 4, 32, dtype=torch.float16, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=rows,
                                       num_splits=2, return_softmax_lse=True)
    assert_matches(out, lse, *decode_reference(q, k_cache, v_cache, seqlens, cache_batch_idx=rows))


def shifted_left(cache, pads):
    """A contiguous cache whose sequence b starts at the original's key pads[b] (NaN after)."""
    out = torch.full_like(cache, float("nan"))
    for b, pad in enumerate(pads):
        out[b, :cache.shape[1] - pad] = cache[b, pad:]
    return out


def check_append(batch, seqlen_new, heads, kv_heads, headdim, capacity, old, dtype, device, page_size,
                 interleaved, causal, rotary_dim=16, leftpad=None):
    """Append k/v (k rotated) at each sequence's end, then attend: the new slots hold the new
    keys and values, every other cache element is unchanged, the output matches the reference.
    `leftpad` (a list): sequence b's keys start at cache index leftpad[b] (the padding before is
    NaN; rotary positions stay cache indices, as flash-attn's); the reference sees the cache
    shifted left."""
    k_cache, v_cache, block_table = make_cache(batch, capacity, kv_heads, headdim, dtype, device, old, page_size)
    pads = leftpad or [0] * batch
    for b, pad in enumerate(pads):
        k_cache[b, :pad] = v_cache[b, :pad] = float("nan")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch, seqlen_new, heads, headdim, dtype=dtype, device=device)
    k_new, v_new = (torch.randn(batch, seqlen_new, kv_heads, headdim, dtype=dtype, device=device) for _ in range(2))
    cos, sin = rotary_tables(capacity, rotary_dim, dtype, device)
    lengths = torch.tensor(old, dtype=torch.int32, device=device)
    pad_tensor = torch.tensor(pads, dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=lengths, block_table=block_table, causal=causal,
                                       rotary_interleaved=interleaved, num_splits=2, return_softmax_lse=True,
                                       cache_leftpad=None if leftpad is None else pad_tensor)
    new_positions = lengths.long()[:, None] + torch.arange(seqlen_new, device=device)  # (B, S_new)
    k_rotated = rotary_reference(k_new, cos, sin, new_positions, interleaved)  # at their cache indices
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=device)
    for b in range(batch):
        index = slots(k_cache, block_table, b, old[b], seqlen_new)
        written[index] = True
        # rotated in float32 and rounded once: at most an ulp from the float64 rotation rounded
        torch.testing.assert_close(k_cache[index], k_rotated[b].to(dtype), atol=1e-5, rtol=2 * torch.finfo(dtype).eps)
        assert torch.equal(v_cache[index], v_new[b]), f"sequence {b}: v not appended as given"
    untouched = ~written
    assert torch.equal(k_cache[untouched].isnan(), before_k[untouched].isnan())
    assert torch.equal(k_cache[untouched].nan_to_num(), before_k[untouched].nan_to_num()), "k_cache changed elsewhere"
    assert torch.equal(v_cache[untouched].nan_to_num(), before_v[untouched].nan_to_num()), "v_cache changed elsewhere"

    q_positions = new_positions if causal else lengths.long()[:, None].expand(batch, seqlen_new)
    q_rotated = rotary_reference(q, cos, sin, q_positions, interleaved)
    keys, values = gathered(k_cache, block_table, None, batch), gathered(v_cache, block_table, None, batch)
    keys, values = shifted_left(keys, pads), shifted_left(values, pads)
    # the reference attends with the float64 rotated q; the yardstick with it rounded to dtype
    _, _, same = decode_reference(q_rotated.to(dtype), keys, values, lengths - pad_tensor + seqlen_new,
                                  causal=causal)
    seqlens_k = (lengths - pad_tensor + seqlen_new).cpu()
    ref_out, _ = attention_reference(q_rotated, keys, values, seqlens_k=seqlens_k, causal=causal)
    # the logsumexp of the q the kernel attends with: rotated, then rounded to dtype (fa2::rotary's
    # output); in bf16 that rounding alone moves it by up to ~4e-3 from the float64 rotation's
    _, ref_lse = attention_reference(q_rotated.to(dtype), keys, values, seqlens_k=seqlens_k, causal=causal)
    assert_matches(out, lse, ref_out, ref_lse, same)


@pytest.mark.parametrize("page_size,interleaved,causal", [(0, True, True), (16, False, True), (16, True, False)])
def test_append_then_attend_writes_only_the_new_slots(page_size, interleaved, causal, device):
    # the last sequence fills its cache exactly; rotary_dim 16 of headdim 32
    check_append(3, 2, 4, 2, 32, 48, [5, 0, 46], torch.float16, device, page_size, interleaved, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_left_padded_caches_start_at_cache_leftpad(causal, device):
    """cache_leftpad: keys before each sequence's pad (NaN here) are neither read nor seen, the
    new keys go in at cache_seqlens and rotate there, at their cache index (flash-attn's
    convention), and the output equals attention over the cache shifted left by the pad."""
    check_append(3, 2, 4, 2, 32, 64, [9, 3, 50], torch.float16, device, 0, True, causal,
                 leftpad=[4, 3, 17])


def test_left_padding_splits_only_the_keys_after_the_pad(device):
    """Many splits over a cache whose first blocks are padding: the result is num_splits=1's."""
    k_cache, v_cache, _ = make_cache(2, 256, 2, 16, torch.float32, device, [200, 256])
    pads = torch.tensor([150, 0], dtype=torch.int32, device=device)
    k_cache[0, :150] = v_cache[0, :150] = float("nan")
    q = torch.randn(2, 1, 4, 16, device=device)
    seqlens = torch.tensor([200, 256], dtype=torch.int32, device=device)
    ref_out, ref_lse, same = decode_reference(q, shifted_left(k_cache, [150, 0]), shifted_left(v_cache, [150, 0]),
                                              seqlens - pads)
    for splits in (1, 3, 8):
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=pads,
                                           num_splits=splits, return_softmax_lse=True)
        assert_matches(out, lse, ref_out, ref_lse, same)


def test_lse_only_when_asked(device):
    k_cache, v_cache, _ = make_cache(1, 32, 1, 16, torch.float32, device, [20])
    q = torch.randn(1, 1, 2, 16, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, num_splits=1)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape


def test_heuristic_fills_the_gpu_at_batch_one():
    # H200: 132 SMs; batch 1, 8 kv heads, one query tile, a 64k cache in blocks of 64
    splits = choose_num_splits(1, 8, 1, 65536, 64, 132)
    assert splits * 8 >= 132
    # at most PROGRAMS_PER_SM programs per SM: no partial second wave (32 kv heads: 8 splits, not 9)
    assert choose_num_splits(1, 32, 1, 65536, 64, 132) == 8
    assert choose_num_splits(8, 8, 1, 8192, 64, 132) * 64 <= decode.PROGRAMS_PER_SM * 132
    assert choose_num_splits(64, 32, 1, 4096, 64, 132) == 1  # 2048 programs already
    assert choose_num_splits(32, 8, 1, 4096, 64, 132) == 1  # 256 programs: every SM has one
    assert choose_num_splits(1, 8, 1, 1024, 64, 132) == 16  # SMs the floor leaves idle: one block a split
    assert choose_num_splits(1, 8, 1, 1024, 64, 132, fill_sms=False) == 4  # the floor alone
    assert choose_num_splits(1, 32, 1, 1024, 64, 132) == 4  # the floor's 4 splits already give each SM a program
    assert choose_num_splits(1, 8, 1, 4096, 64, 132) == 16  # the floor: 4 blocks each
    assert choose_num_splits(1, 8, 1, 256, 64, 132) == 1  # 4 key blocks: the floor does not split them
    assert choose_num_splits(1, 1, 1, 1 << 20, 64, 132) == decode.MAX_SPLITS


def test_tile_turns_shallow_beyond_one_wave_of_the_deep_pipeline():
    # H200: 132 SMs, three 3-stage programs per SM (396); batch 32 x 8 kv heads is 256 programs,
    # batch 64 x 8 kv heads 512 (no split: one program per SM already)
    assert decode.choose_tile(256, 132) == decode.GPU_CONFIG
    assert decode.choose_tile(decode.DEEP_PROGRAMS_PER_SM * 132, 132) == decode.GPU_CONFIG
    assert decode.choose_tile(512, 132) == decode.SHALLOW_CONFIG
    assert decode.SHALLOW_CONFIG[0] == decode.GPU_CONFIG[0]  # the same key block: the same split count
    assert decode.SHALLOW_CONFIG[2] < decode.GPU_CONFIG[2]
    assert decode.choose_tile(512, 132, block_d=64) == decode.GPU_CONFIG  # measured at head dim 128 only


def test_gqa_packs_each_kv_heads_queries_into_one_tile(device, monkeypatch):
    """Grid (splits, batch x kv heads, query tiles): 8 q heads per kv head and one token fill one
    16-row tile (8 rows padded to the tile's minimum), so each program reads its kv head's keys
    once for all 8; num_splits=0 splits."""
    grids = []
    real = decode._split_launcher

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(decode, "_split_launcher", Spy())
    # 2 programs without a split, fewer than the interpreter's INTERPRETER_SMS: the heuristic splits
    k_cache, v_cache, _ = make_cache(2, 256, 1, 16, torch.float16, device, [256, 100])
    q = torch.randn(2, 1, 8, 16, dtype=torch.float16, device=device)
    seqlens = torch.tensor([256, 100], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, return_softmax_lse=True)
    splits = choose_num_splits(2, 1, 1, 256, decode.INTERPRETER_CONFIG[0], decode.INTERPRETER_SMS)
    assert splits > 1 and grids == [(splits, 2 * 1, 1)]
    assert_matches(out, lse, *decode_reference(q, k_cache, v_cache, seqlens))


def _bad_call(**overrides):
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    k_cache, v_cache, _ = make_cache(2, 32, 2, 16, torch.float16, "cpu", [32, 32])
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": torch.tensor([3, 7], dtype=torch.int32)}
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,error,match", [
    ({"q": torch.randn(2, 1, 3, 16, dtype=torch.float16)}, ValueError, "kv heads"),
    ({"q": torch.randn(2, 1, 4, 8, dtype=torch.float16)}, ValueError, "head dim"),
    ({"q": torch.randn(3, 1, 4, 16, dtype=torch.float16)}, ValueError, "batch"),
    ({"cache_seqlens": torch.tensor([3, 33], dtype=torch.int32)}, ValueError, "cache_seqlens"),
    ({"cache_seqlens": torch.tensor([3, 7])}, TypeError, "cache_seqlens must be torch.int32"),
    ({"cache_seqlens": 40}, ValueError, "cache_seqlens=40"),
    ({"cache_batch_idx": torch.tensor([0, 2], dtype=torch.int32)}, ValueError, "cache_batch_idx"),
    ({"cache_leftpad": torch.tensor([0, 0], dtype=torch.int64)}, TypeError, "cache_leftpad must be torch.int32"),
    ({"cache_leftpad": torch.tensor([0, 8], dtype=torch.int32)}, ValueError, r"cache_leftpad must hold values in \[0, cache_seqlens\]"),
    ({"cache_leftpad": torch.tensor([0], dtype=torch.int32)}, ValueError, "cache_leftpad must have shape"),
    ({"window_size": (-2, 0)}, ValueError, "window_size"),
    ({"num_splits": -1}, ValueError, "num_splits"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"k": torch.randn(2, 1, 2, 16, dtype=torch.float16)}, ValueError, "k and v must be given together"),
])
def test_bad_input_is_refused_by_name(overrides, error, match):
    with pytest.raises(error, match=match):
        flash_attn_with_kvcache(**_bad_call(**overrides))


def test_more_batch_x_kv_heads_than_the_grid_takes_is_refused(monkeypatch):
    """Past the split kernel's grid axis (row_chunks.GRID_ROWS, lowered here to 3), a clear error."""
    monkeypatch.setattr(decode, "GRID_ROWS", 3)
    with pytest.raises(ValueError, match="q batch x k_cache heads: at most 3"):
        flash_attn_with_kvcache(**_bad_call())


def test_bad_block_tables_and_page_sizes_are_refused():
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    k_cache, v_cache, table = make_cache(2, 32, 2, 16, torch.float16, "cpu", [20, 32], page_size=16)
    seqlens = torch.tensor([20, 32], dtype=torch.int32)
    with pytest.raises(TypeError, match="block_table must be an int32"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table.long())
    outside = table.clone()
    outside[1, 1] = k_cache.shape[0]  # used by sequence 1's keys 16..31
    with pytest.raises(ValueError, match="block_table entries"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=outside)
    odd = torch.randn(8, 24, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="page size"):
        flash_attn_with_kvcache(q, odd, odd.clone(), cache_seqlens=seqlens, block_table=table)

def test_pages_spanning_more_than_int32_offsets_are_refused(monkeypatch):
    """The split kernel works out a row's offset in its page in int32: a page spanning
    PAGE_SPAN_LIMIT elements or more (page size x row stride, of K or V) is refused (the limit
    lowered here to this test's page: 16 rows of 2 heads x 16 elements)."""
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    k_cache, v_cache, table = make_cache(2, 32, 2, 16, torch.float16, "cpu", [20, 32], page_size=16)
    seqlens = torch.tensor([20, 32], dtype=torch.int32)
    monkeypatch.setattr(decode, "PAGE_SPAN_LIMIT", 16 * 32)
    with pytest.raises(ValueError, match="must span fewer than 512 elements"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
    monkeypatch.setattr(decode, "PAGE_SPAN_LIMIT", 16 * 32 + 1)  # one more: taken
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table)


@pytest.mark.parametrize("page_size", [0, 16])
def test_append_past_the_end_is_refused_and_writes_nothing(page_size):
    k_cache, v_cache, table = make_cache(2, 32, 2, 16, torch.float16, "cpu", [31, 4], page_size=page_size)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(2, 2, 4, 16, dtype=torch.float16)
    k_new, v_new = (torch.randn(2, 2, 2, 16, dtype=torch.float16) for _ in range(2))
    with pytest.raises(ValueError, match="appending 2 new keys"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, block_table=table,
                                cache_seqlens=torch.tensor([31, 4], dtype=torch.int32))
    for after, before in ((k_cache, before_k), (v_cache, before_v)):
        assert torch.equal(after.nan_to_num(), before.nan_to_num()) and torch.equal(after.isnan(), before.isnan())


def test_custom_ops_pass_opcheck(device):
    k_cache, v_cache, table = make_cache(2, 32, 2, 16, torch.float16, device, [32, 32], page_size=16)
    k_cache, v_cache = torch.randn_like(k_cache), torch.randn_like(v_cache)  # opcheck compares: no NaN
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16, device=device)
    seqlens = torch.tensor([9, 17], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.fa2.fwd_kvcache.default,
                          (q, k_cache, v_cache, seqlens, None, table, None, 0.25, -1, 0, 0.0, 2))
    k_new, v_new = (torch.randn(2, 1, 2, 16, dtype=torch.float16, device=device) for _ in range(2))
    cos, sin = rotary_tables(32, 8, torch.float16, device)
    torch.library.opcheck(torch.ops.fa2.kvcache_append.default,
                          (k_cache, v_cache, k_new, v_new, seqlens, None, table, cos, sin, True))
    torch.library.opcheck(torch.ops.fa2.rotary.default, (q, cos, sin, seqlens, True, False))


def check_compiled_step(batch, heads, kv_heads, headdim, capacity, dtype, device):
    """A decode step (append, then attend) under torch.compile(fullgraph=True) equals eager."""
    k_cache, v_cache, table = make_cache(batch, capacity, kv_heads, headdim, dtype, device, [capacity] * batch,
                                         page_size=16, spare_pages=0)  # no NaN: the caches are compared
    q = torch.randn(batch, 1, heads, headdim, dtype=dtype, device=device)
    k_new, v_new = (torch.randn(batch, 1, kv_heads, headdim, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.randint(0, capacity, (batch,), dtype=torch.int32, device=device)

    def step(q, k_cache, v_cache, k, v, seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                                       causal=True, num_splits=2)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    expected = step(q, eager_k, eager_v, k_new, v_new, seqlens)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k_new, v_new, seqlens)
    assert torch.equal(got, expected)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), "the compiled append differs"


def test_decode_step_compiles_fullgraph(device):
    check_compiled_step(2, 4, 2, 16, 32, torch.float16, device)


# ---- GPU: the same checks at real sizes, bf16 and fp16 ----

GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("kv_heads", [8, 32])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_gpu_decode_matches_reference(dtype, kv_heads, page_size, num_splits):
    seqlens = [4096, 0, 1, 1000, 2049, 3333]
    check_decode(6, 1, 32, kv_heads, 128, 4096, seqlens, dtype, "cuda", page_size=page_size, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("page_size", [0, 16])
def test_gpu_decode_beyond_one_wave_takes_the_shallow_tile(dtype, page_size):
    # batch 64 x 8 kv heads: 512 programs, beyond one wave of the 3-stage tile on an H100/H200
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    programs = 64 * 8 * decode.choose_num_splits(64, 8, 1, 1024, decode.GPU_CONFIG[0], sms)
    if decode.choose_tile(programs, sms) != decode.SHALLOW_CONFIG:
        pytest.skip(f"{programs} programs fit one wave of the 3-stage tile on this GPU's {sms} SMs")
    generator = torch.Generator().manual_seed(3)
    seqlens = [1024, 0, 1, *torch.randint(0, 1025, (61,), generator=generator).tolist()]
    check_decode(64, 1, 32, 8, 128, 1024, seqlens, dtype, "cuda", page_size=page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_several_tokens_causal_window_softcap_alibi(dtype):
    slopes = torch.rand(32, device="cuda", dtype=torch.float32) * 0.1
    check_decode(4, 4, 32, 8, 128, 2048, [2048, 3, 700, 1500], dtype, "cuda", page_size=64, causal=True,
                 window_size=(512, 0), softcap=30.0, alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_batch_one_long_cache_splits_agree(dtype):
    k_cache, v_cache, _ = make_cache(1, 65536, 8, 128, dtype, "cuda", [65536])
    q = torch.randn(1, 1, 32, 128, dtype=dtype, device="cuda")
    lengths = torch.tensor([65536], dtype=torch.int32, device="cuda")
    one, lse_one = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=1,
                                           return_softmax_lse=True)
    split, lse_split = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               return_softmax_lse=True)
    assert_matches(split, lse_split, *decode_reference(q, k_cache, v_cache, lengths))
    torch.testing.assert_close(lse_split, lse_one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.float(), one.float(), atol=ABS_EPS[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("page_size,interleaved,causal", [(0, True, True), (16, False, True), (256, True, False)])
def test_gpu_append_then_attend(dtype, page_size, interleaved, causal):
    check_append(4, 1, 32, 8, 128, 1024, [0, 511, 1023, 100], dtype, "cuda", page_size, interleaved, causal,
                 rotary_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_left_padded_append_then_attend(dtype, causal):
    check_append(4, 1, 32, 8, 128, 4096, [3000, 511, 4095, 100], dtype, "cuda", 0, False, causal,
                 rotary_dim=128, leftpad=[2900, 0, 129, 100])


@pytest.mark.gpu
def test_gpu_decode_step_compiles_fullgraph():
    check_compiled_step(4, 32, 8, 128, 512, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_new_lengths_and_appends():
    """A captured decode step (append, attend) replayed with new lengths equals the eager call."""
    batch, heads, kv_heads, headdim, capacity, dtype = 4, 32, 8, 128, 2048, torch.bfloat16
    k_cache, v_cache, table = make_cache(batch, capacity, kv_heads, headdim, dtype, "cuda", [capacity] * batch,
                                         page_size=16, spare_pages=0)
    q = torch.randn(batch, 1, heads, headdim, dtype=dtype, device="cuda")
    k_new, v_new = (torch.randn(batch, 1, kv_heads, headdim, dtype=dtype, device="cuda") for _ in range(2))
    seqlens = torch.tensor([5, 100, 1500, 2000], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=table, causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lengths in ([0, 2046, 17, 999], [2047, 1, 640, 64]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        eager_k, eager_v = k_cache.clone(), v_cache.clone()
        expected = flash_attn_with_kvcache(q, eager_k, eager_v, k_new, v_new, cache_seqlens=seqlens,
                                           block_table=table, causal=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay with lengths {lengths} differs from eager"
        assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


@pytest.mark.gpu
def test_gpu_bad_block_table_entries_are_refused():
    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k_cache, v_cache, table = make_cache(2, 256, 8, 128, torch.bfloat16, "cuda", [256, 100], page_size=16)
    table[1, 3] = -1  # used by sequence 1's keys 48..63
    with pytest.raises(ValueError, match="block_table entries"):
        flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table,
                                cache_seqlens=torch.tensor([256, 100], dtype=torch.int32, device="cuda"))


# ---- the decode suite's grid (harness/decode.py) and report (reports/decode.py), from made-up rows ----

def test_suite_grid_puts_the_anchors_first_and_bounds_memory():
    from harness import decode as suite

    full = suite.grid(quick=False)
    assert [(b, n) for _, b, n in full[:2 * len(suite.ANCHORS)]] == [a for a in suite.ANCHORS for _ in suite.KV_HEADS]
    assert all(suite.kv_bytes(b, n, h) <= suite.MAX_KV_BYTES for h, b, n in full)
    assert (32, 64, 131072) not in full and (8, 1, 131072) in full


def test_suite_report_is_made_from_rows(tmp_path):
    import csv

    from harness import decode as suite
    from reports import decode as decode_report

    env = {column: "x" for column in suite.ROW_ENV_COLUMNS} | {"interpreter": False}
    rates = {("ours-splitkv", "contiguous"): 4000.0, ("ours-nosplit", "contiguous"): 700.0,
             ("ours-splitkv", "paged"): 3900.0, ("sdpa-cudnn", "contiguous"): 4100.0,
             ("sdpa-flash", "contiguous"): 3000.0}
    with (tmp_path / suite.DECODE_CSV).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=suite.COLUMNS)
        writer.writeheader()
        writer.writerow(suite._row(env, provider="device-copy", label="copy", layout="", batch=0, cache_len=0,
                                   kv_heads=0, status="ok", timing="cuda-graph", ms=1.0, kv_bytes=1, gbps=4270.0))
        for kv_heads, batch, cache_len in suite.grid(quick=True):
            for (provider, layout), gbps in rates.items():
                writer.writerow(suite._row(env, provider=provider, label=provider, layout=layout, batch=batch,
                                           cache_len=cache_len, kv_heads=kv_heads, status="ok", timing="cuda-graph",
                                           ms=1.0, kv_bytes=1, gbps=gbps))
            writer.writerow(suite._row(env, provider="fa4", label="FA4", layout="contiguous", batch=batch,
                                       cache_len=cache_len, kv_heads=kv_heads, status="unavailable",
                                       reason="flash-attn-4 is not installed"))
    report = decode_report.write_decode_report(tmp_path).read_text()
    assert "| 1 x 64k | 4,000 (1,000.0) | 700 (1,000.0) | 3,900 (1,000.0) | 4,100 (1,000.0) | 3,000 (1,000.0) |" in report
    assert "ours / SDPA cuDNN >= 0.95 | 0.98x | met" in report
    assert "ours / ours num_splits=1 >= 5.0 | 5.71x | met" in report
    assert "paged / contiguous >= 0.9 | min 0.975x" in report
    assert "4,270 GB/s" in report and "flash-attn-4 is not installed" in report
    assert (tmp_path / "plots" / "decode_bandwidth.png").stat().st_size > 0
    assert "the bar needs" not in report  # 5 x 700 GB/s is below the run's fastest row

    # num_splits=1 at 1,000 GB/s: 5x of it is above every row of the run, and the report says so
    rows = suite.load_rows(tmp_path)
    rows.loc[rows.provider == "ours-nosplit", "gbps"] = 1000.0
    rows.to_csv(tmp_path / suite.DECODE_CSV, index=False)
    report = decode_report.write_decode_report(tmp_path).read_text()
    assert "4.00x (the bar needs 5,000 GB/s; the fastest row of the run read 4,100) | not met" in report


def test_suite_runs_end_to_end_in_the_interpreter(tmp_path, monkeypatch):
    """The measuring loop, providers and report on tiny fp16 sizes (times are not performance)."""
    from harness import decode as suite
    from reports import decode as decode_report

    monkeypatch.setattr(suite, "HEADS", 4)
    monkeypatch.setattr(suite, "HDIM", 16)
    monkeypatch.setattr(suite, "DTYPE", torch.float16)
    monkeypatch.setattr(suite, "KV_HEADS", (2, 4))
    monkeypatch.setattr(suite, "QUICK_GRID", {"batch": (1,), "cache_len": (128,)})
    monkeypatch.setattr(suite, "ANCHORS", ((1, 128),))
    suite.measure_suite(True, tmp_path, device=torch.device("cpu"))
    rows = suite.load_rows(tmp_path)
    ours = rows[rows.provider.isin(["ours-splitkv", "ours-nosplit"])]
    assert len(ours) == 8 and (ours.status == "ok").all(), ours[["provider", "layout", "status", "reason"]]
    assert (ours.rel_err.astype(float) < 1e-2).all()
    splits = {(r.provider, r.layout): json.loads(r.config)["num_splits"] for r in ours.itertuples() if r.kv_heads == 2}
    assert splits[("ours-splitkv", "contiguous")] > 1 and splits[("ours-nosplit", "paged")] == 1
    fa1 = rows[rows.provider == "fa1-rung0"].set_index("kv_heads").status
    assert fa1[2] == "unsupported" and fa1[4] == "ok"
    assert (rows[rows.provider == "sdpa-flash"].status == "unavailable").all()  # CUDA only
    assert "ours split-KV" in decode_report.write_decode_report(tmp_path).read_text()


def test_value_checks_are_not_even_built_while_a_cuda_graph_is_captured(monkeypatch):
    """Their mask kernels would otherwise be captured and run at every replay."""
    from kernels import decode as kv

    built = []

    def checks():
        built.append(True)
        return [(torch.tensor([True]), "bad entry")]

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    kv._check_values(torch.device("cuda"), checks)
    assert not built
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(ValueError, match="bad entry"):
        kv._check_values(torch.device("cuda"), checks)
    assert built


@pytest.mark.parametrize("tile", [(64, 4), (64, 0, 3), (64.0, 4, 3), "abc"])
def test_a_malformed_tile_is_refused_by_name(tile):
    """flash_attn_with_kvcache's `tile` (the split kernel's block_n, num_warps, num_stages) must be
    three positive ints."""
    from kernels.decode import flash_attn_with_kvcache

    q = torch.randn(1, 1, 2, 32, dtype=torch.float16)
    cache = torch.randn(1, 16, 2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="tile must be"):
        flash_attn_with_kvcache(q, cache, cache.clone(), tile=tile)
