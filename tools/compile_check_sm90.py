import os
os.environ.pop("TRITON_INTERPRET", None)
import triton, torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.flash_attn as fa
target = GPUTarget("cuda", 90, 32)
def sig(fn, consts, ptr_dtype="*bf16"):
    s = {}
    for name in fn.arg_names:
        if name in consts: s[name] = "constexpr"
        elif name[0].isupper() and name not in ("LSE", "Delta"): s[name] = ptr_dtype
        elif name in ("LSE", "Delta"): s[name] = "*fp32"
        elif "scale" in name: s[name] = "fp32"
        else: s[name] = "i32"
    return s
for causal in (False, True):
  for d, bd in ((128,128),(59,64)):
    consts = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=128, BLOCK_N=64, CAUSAL=causal, EVEN_M=True)
    k = triton.compile(ASTSource(fa._flash_fwd_kernel, sig(fa._flash_fwd_kernel, consts), consts), target=target, options=dict(num_warps=8, num_stages=3))
    print("fwd", causal, d, "regs", k.n_regs if hasattr(k,'n_regs') else '?', "spills", getattr(k,'n_spills','?'), "wgmma" if "wgmma" in k.asm["ptx"] else "no wgmma", "shared", k.metadata.shared)
    consts = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=32, BLOCK_N=128, CAUSAL=causal, EVEN_M=True, EVEN_N=True)
    k = triton.compile(ASTSource(fa._flash_bwd_dkdv_kernel, sig(fa._flash_bwd_dkdv_kernel, consts), consts), target=target, options=dict(num_warps=4, num_stages=3))
    print("dkdv", causal, d, "wgmma" if "wgmma" in k.asm["ptx"] else "no wgmma", "shared", k.metadata.shared)
    consts = dict(HEAD_DIM=d, BLOCK_D=bd, BLOCK_M=128, BLOCK_N=32, CAUSAL=causal, EVEN_M=True)
    k = triton.compile(ASTSource(fa._flash_bwd_dq_kernel, sig(fa._flash_bwd_dq_kernel, consts), consts), target=target, options=dict(num_warps=4, num_stages=3))
    print("dq", causal, d, "wgmma" if "wgmma" in k.asm["ptx"] else "no wgmma", "shared", k.metadata.shared)
