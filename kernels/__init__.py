"""Reference attention kernels in Triton. `flash_attn_func` and the packed variants are
drop-ins for flash-attn's functions of the same names."""

from kernels.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func"]
