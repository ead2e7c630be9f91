"""FlashAttention-2 kernels in Triton and Gluon with flash-attn's Python API.

`flash_attn_func`, the packed variants and the variable-length ones are drop-ins for
flash-attn's functions of the same names (kernels/interface.py); they are registered as PyTorch
custom ops `torch.ops.fa2.*` (kernels/ops.py) so torch.compile sees one opaque node. The layout
of this package, by role: configs.py (block-size tables), forward.py and backward.py (the Triton
kernels; backward_steps.py the loops backward.py and backward_features.py share), hopper/ (the
Gluon kernels for sm_90, one role a file) and flash_attn_hopper.py (their host side), dispatch.py
(which kernel serves a call), checks.py (argument checks), launch.py (cached launches), decode.py and decode_kernels.py
(split-KV decoding over a KV cache, `flash_attn_with_kvcache`), fa_ladder.py (the ablation rungs).
"""

from .configs import BwdConfig, FwdConfig
from .decode import flash_attn_with_kvcache
from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "BwdConfig",
    "FwdConfig",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
