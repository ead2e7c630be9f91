"""The Gluon kernels for Hopper (FA2 in FlashAttention-3's warp layout), one role a file: fwd.py
(the forward, dense and packed), bwd.py (the dK/dV kernel and its steps), bwd_varlen.py (its
packed-sequence variant), bwd_wide.py (the dK/dV kernel at head dim 192), dq_cast.py (the fused dQ's accumulator and cast), shared.py (tile sizes,
layouts). The host side (descriptors, grids, plans) is kernels/flash_attn_hopper.py."""
