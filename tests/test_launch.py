"""kernels/launch.py's CachedLauncher, on a stand-in kernel (no GPU needed): which calls go
through the JIT, which launch the kept compiled kernel, and with what arguments. The GPU test
`test_gpu_repeated_calls_take_the_cached_launch` checks the production launches and their
results."""
from __future__ import annotations

import pytest
import torch
from triton.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

from baselines.reference import attention_reference, attention_same_dtype
from kernels import backward, flash_attn_func, flash_attn_hopper, forward
from kernels.dispatch import tma_compatible
from kernels.launch import MAX_KEYS, CachedLauncher, DirectLaunch, descriptor_like, descriptor_template
from tests.attention_checks import (  # noqa: F401 (poisoned_allocations: a fixture, used by name)
    assert_close_to_reference,
    make_qkv,
    poisoned_allocations,
    shape_id,
)


class FakeCompiled(CompiledKernel):
    def __init__(self):  # no compilation: records the direct launches
        self.launches = []

    def __getitem__(self, grid):  # as CompiledKernel's: three grid dimensions, each read
        return lambda *args: self.launches.append(((grid[0], grid[1], grid[2]), args))


class FakeKernel:
    """A kernel (X, n, scale, BLOCK: constexpr, EVEN: constexpr) whose JIT launches are recorded,
    each returning a compiled kernel of its own (`compiled`: the latest)."""
    def __init__(self):
        self.arg_names = ["X", "n", "scale", "BLOCK", "EVEN"]
        self.jit_launches, self.compiled = [], None

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_launches.append((grid, args, kwargs))
            self.compiled = FakeCompiled()
            return self.compiled
        return run


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cached = CachedLauncher(FakeKernel())
    cached.interpreted = False
    return cached


def test_a_repeated_key_launches_its_own_compiled_kernel_with_every_argument_in_signature_order(launcher):
    x = torch.randn(64)
    launcher[(4, 2)](x, 64, 0.5, EVEN=True, BLOCK=16, num_warps=4)  # keywords not in signature order
    first = launcher.kernel.compiled
    launcher[(4, 2)](x, 48, 0.5, EVEN=True, BLOCK=16, num_warps=4)  # another key: a second kernel
    second = launcher.kernel.compiled
    assert len(launcher.kernel.jit_launches) == 2 and first is not second
    y = torch.randn(64)  # another tensor, same dtype and alignment; another scale (not specialised)
    result = launcher[(8, 2)](y, 64, 0.25, EVEN=True, BLOCK=16, num_warps=4)
    assert result is first and len(launcher.kernel.jit_launches) == 2 and not second.launches
    assert first.launches == [((8, 2, 1), (y, 64, 0.25, 16, True))]  # BLOCK before EVEN, as declared
    launcher[(8,)](y, 64, 0.25, EVEN=True, BLOCK=16, num_warps=4)
    launcher[(8, 2, 3)](y, 64, 0.25, EVEN=True, BLOCK=16, num_warps=4)
    assert [grid for grid, _ in first.launches[1:]] == [(8, 1, 1), (8, 2, 3)]
    launcher[(4, 2)](y, 48, 0.25, EVEN=True, BLOCK=16, num_warps=4)  # the second key: the second kernel
    assert second.launches == [((4, 2, 1), (y, 48, 0.25, 16, True))] and len(first.launches) == 3


class LauncherHolder:
    """A module-like holder of a launcher, as forward.py holds _fwd_launcher."""


def test_a_direct_launch_keeps_the_first_calls_compiled_kernel_and_binds_its_constexprs(launcher):
    holder = LauncherHolder()
    holder.launcher = launcher
    direct = DirectLaunch(holder, "launcher", (4, 2), {"EVEN": True, "BLOCK": 16, "num_warps": 4})
    x, y = torch.randn(64), torch.randn(64)
    direct(x, 64, 0.5)
    compiled = launcher.kernel.compiled
    direct(y, 64, 0.25)  # direct: no JIT launch, no CachedLauncher key
    assert len(launcher.kernel.jit_launches) == 1
    assert compiled.launches == [((4, 2, 1), (y, 64, 0.25, 16, True))]


class FakeRunner:
    """A compiled kernel's `run` (Triton 3.6's CudaLauncher) with its C launch recorded."""
    launch_cooperative_grid, launch_pdl, global_scratch_size, profile_scratch_size = False, True, 0, 0

    def __init__(self):
        self.c_launches = []

    def launch(self, *args):
        self.c_launches.append(args)


def test_a_direct_launch_calls_the_c_launcher_while_no_launch_hook_is_set(launcher, monkeypatch):
    """After the first call a kernel that needs no scratch is launched by Triton's C launcher with
    no launch metadata and no hooks, as long as Triton's hook chains are empty (Triton 3.6 keeps
    them as HookChain objects, never None); a hook set (a profiler's) sends the launch through the
    compiled kernel's own runner, which calls it."""
    from triton import knobs

    from kernels import launch as launch_module

    runner = FakeRunner()
    monkeypatch.setattr(FakeCompiled, "run", runner, raising=False)
    monkeypatch.setattr(FakeCompiled, "function", 77, raising=False)
    monkeypatch.setattr(FakeCompiled, "packed_metadata", ("packed",), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    assert launch_module.no_launch_hooks()  # Triton's default: empty chains
    holder = LauncherHolder()
    holder.launcher = launcher
    direct = DirectLaunch(holder, "launcher", (4, 2), {"EVEN": True, "BLOCK": 16, "num_warps": 4})
    x, y = torch.randn(64), torch.randn(64)
    direct(x, 64, 0.5)  # through the JIT
    direct(y, 64, 0.25)
    compiled = launcher.kernel.compiled
    assert not compiled.launches and runner.c_launches == [
        (4, 2, 1, 1234, 77, False, True, None, None, ("packed",), None, None, None, y, 64, 0.25, 16, True)]
    hook = lambda metadata: None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not launch_module.no_launch_hooks()
        direct(y, 64, 0.25)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(runner.c_launches) == 1 and compiled.launches == [((4, 2, 1), (y, 64, 0.25, 16, True))]


def test_a_direct_launch_follows_a_launcher_that_was_replaced(launcher):
    holder = LauncherHolder()
    holder.launcher = launcher
    direct = DirectLaunch(holder, "launcher", (4, 2), {"EVEN": True, "BLOCK": 16, "num_warps": 4})
    direct(torch.randn(64), 64, 0.5)
    spied = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: spied.append((grid, args, kwargs))

    holder.launcher = Spy()  # as a test's monkeypatch does
    x = torch.randn(64)
    direct(x, 64, 0.5)
    assert spied == [((4, 2), (x, 64, 0.5), {"EVEN": True, "BLOCK": 16, "num_warps": 4})]


def test_descriptor_like_swaps_only_the_base():
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    template = TensorDescriptor(a, [64, 32], [32, 1], [16, 32])
    copy = descriptor_like(template, b)
    assert copy.base is b and template.base is a
    assert (copy.shape, copy.strides, copy.block_shape, copy.padding) == (
        template.shape, template.strides, template.block_shape, template.padding)


def test_a_descriptor_template_keeps_no_tensor_and_descriptor_like_gives_it_one():
    """A plan keeps templates: the tensor of the call that made it must not stay alive (a CUDA-graph
    pool's warm-up allocations would), and a template made like this launches as the original."""
    import weakref

    a, b = torch.randn(64, 32), torch.randn(64, 32)
    template = descriptor_template(TensorDescriptor(a, [64, 32], [32, 1], [16, 32]))
    alive = weakref.ref(a)
    del a
    assert template.base is None and alive() is None
    copy = descriptor_like(template, b)
    assert copy.base is b and (copy.shape, copy.strides, copy.block_shape) == ([64, 32], [32, 1], [16, 32])


def test_a_grid_function_goes_through_the_jit(launcher):
    for _ in range(2):
        launcher[lambda meta: (4,)](torch.randn(4), 4, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.kernel.jit_launches) == 2 and not launcher.kernel.compiled.launches


@pytest.mark.parametrize("change", ["int value", "int to bool", "constexpr", "launch option", "dtype", "alignment",
                                    "device"])
def test_anything_triton_specialises_on_goes_through_the_jit(launcher, change, monkeypatch):
    x = torch.randn(65)
    call = {"args": (x[:64], 64, 0.5), "kwargs": {"BLOCK": 16, "EVEN": True, "num_warps": 4}}
    launcher[(1,)](*call["args"], **call["kwargs"])
    if change == "int value":
        call["args"] = (x[:64], 48, 0.5)
    elif change == "int to bool":
        call["args"] = (x[:64], True, 0.5)
        launcher[(1,)](x[:64], 1, 0.5, **call["kwargs"])  # 1 == True: a second key of its own
        launcher.kernel.jit_launches.pop()
    elif change == "constexpr":
        call["kwargs"]["BLOCK"] = 32
    elif change == "launch option":
        call["kwargs"]["num_warps"] = 8
    elif change == "dtype":
        call["args"] = (x[:64].half(), 64, 0.5)
    elif change == "alignment":
        call["args"] = (x[1:], 64, 0.5)  # 4 bytes past a 16-byte boundary
    else:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    launcher[(1,)](*call["args"], **call["kwargs"])
    assert len(launcher.kernel.jit_launches) == 2 and not launcher.kernel.compiled.launches


@pytest.mark.parametrize("change", ["block shape", "strides", "dtype", "shape"])
def test_host_descriptors_are_keyed_on_what_their_launch_encodes(launcher, change):
    base = torch.randn(256, 64)
    descriptor = TensorDescriptor(base, [256, 64], [64, 1], [32, 64])
    launcher[(1,)](descriptor, 4, 0.5, BLOCK=16, EVEN=True)
    same = TensorDescriptor(torch.randn(256, 64), [256, 64], [64, 1], [32, 64])
    launcher[(1,)](same, 4, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.kernel.jit_launches) == 1  # another tensor, the same description: a hit
    other = {"block shape": lambda: TensorDescriptor(base, [256, 64], [64, 1], [64, 64]),
             "strides": lambda: TensorDescriptor(torch.randn(256, 128), [256, 64], [128, 1], [32, 64]),
             "dtype": lambda: TensorDescriptor(base.half(), [256, 64], [64, 1], [32, 64]),
             "shape": lambda: TensorDescriptor(base, [128, 64], [64, 1], [32, 64])}[change]()
    launcher[(1,)](other, 4, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.kernel.jit_launches) == 2


def test_a_kernel_with_pre_run_hooks_always_goes_through_the_jit(launcher):
    launcher.kernel.pre_run_hooks = [lambda *args, **kwargs: None]  # Triton runs them at each JIT launch
    for _ in range(2):
        launcher[(1,)](torch.randn(4), 4, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.kernel.jit_launches) == 2 and not launcher.compiled


def test_the_debug_knob_is_part_of_the_key(launcher, monkeypatch):
    from triton import knobs

    launcher[(1,)](torch.randn(4), 4, 0.5, BLOCK=16, EVEN=True)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    launcher[(1,)](torch.randn(4), 4, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.kernel.jit_launches) == 2


def test_unhashable_arguments_and_defaulted_parameters_are_never_cached(launcher):
    launcher[(1,)](torch.randn(4), [1, 2], 0.5, BLOCK=16, EVEN=True)  # a list: no key
    launcher[(1,)](torch.randn(4), [1, 2], 0.5, BLOCK=16, EVEN=True)
    launcher[(1,)](torch.randn(4), 4, 0.5, BLOCK=16)  # EVEN left to its default: not kept
    launcher[(1,)](torch.randn(4), 4, 0.5, BLOCK=16)
    assert len(launcher.kernel.jit_launches) == 4 and not launcher.compiled


def test_the_cache_is_bounded(launcher):
    for n in range(MAX_KEYS + 1):
        launcher[(1,)](torch.randn(4), n, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.compiled) == 1  # emptied when full, then this call's key


def test_interpreted_kernels_always_go_through_the_jit(launcher):
    launcher.interpreted = True
    for _ in range(2):
        launcher[(1,)](torch.randn(4), 4, 0.5, BLOCK=16, EVEN=True)
    assert len(launcher.kernel.jit_launches) == 2 and not launcher.compiled


# ---------------------------------------------------------------------------------------
# GPU: the production launches (skipped without CUDA).
# ---------------------------------------------------------------------------------------
class CountingKernel:
    """Stands in for a CachedLauncher's kernel: counts the launches that go through the JIT."""

    def __init__(self, kernel):
        self.kernel, self.jit_launches = kernel, 0

    @property
    def arg_names(self):
        return self.kernel.arg_names

    def __getitem__(self, grid):
        self.jit_launches += 1
        return self.kernel[grid]


def count_launches(monkeypatch, launchers) -> dict[str, int]:
    """Counts every launch of `launchers` ('all') and those that go through the JIT ('jit'),
    each launcher's cache emptied first."""
    counts = {"all": 0, "jit": 0}
    for launcher in launchers:
        counting = CountingKernel(launcher.kernel)
        real_launch = launcher.launch

        def launch(grid, args, kwargs, counting=counting, real_launch=real_launch):
            jit_before = counting.jit_launches
            result = real_launch(grid, args, kwargs)
            counts["all"] += 1
            counts["jit"] += counting.jit_launches - jit_before
            return result
        monkeypatch.setattr(launcher, "kernel", counting)
        monkeypatch.setattr(launcher, "launch", launch)
        monkeypatch.setattr(launcher, "compiled", {})
    return counts


def misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose address is 2 bytes past a 16-byte boundary (contiguous otherwise)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t).requires_grad_(t.requires_grad)


@pytest.mark.gpu
@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(4, 512, 512, 2, 256), (4, 512, 512, 3, 128), (2, 1000, 1000, 2, 64),
                                   (2, 1024, 1024, 2, 128), (1, 2048, 2048, 2, 128)],  # the Gluon kernels
                         ids=shape_id)
def test_gpu_repeated_calls_take_the_cached_launch(shape, causal, monkeypatch):
    """The second call of a shape launches every kernel's compiled kernel directly (its plan), a
    call whose inputs are not 16-byte aligned goes through the JIT again (a different
    specialisation, and the pointer path), and every call's forward and gradients match float64."""
    for plans in (forward._PLANS, backward._PLANS):  # no plan of an earlier test holds this shape's kernels
        plans.clear()
    counts = count_launches(monkeypatch, (forward._fwd_launcher, backward._bwd_preprocess_launcher,
                                          backward._bwd_dkdv_launcher, backward._bwd_dq_launcher,
                                          flash_attn_hopper._fwd_launcher, flash_attn_hopper._bwd_dkdv_launcher,
                                          flash_attn_hopper._bwd_dkdv_wide_launcher))
    # the varlen Gluon kernels, which calls off the 128-row grid take (dispatch's GluonPath.PACKED),
    # counted apart: their plans (forward.varlen_forward_gluon, backward._backward_varlen_gluon) launch
    # them as the dense kernels', but the packed backward's preprocess kernel has no plan
    packed_counts = count_launches(monkeypatch, (flash_attn_hopper._fwd_varlen_launcher,))
    packed_bwd_counts = count_launches(monkeypatch, (flash_attn_hopper._bwd_dkdv_varlen_launcher,))
    # launches through a compiled kernel's Python runner, not Triton's C launcher: (kernel, whether it
    # needs global or profiling scratch, which only the runner allocates)
    runner_launches = []
    real_getitem = CompiledKernel.__getitem__

    def runner_getitem(self, grid):
        runner_launches.append((self.name, bool(self.run.global_scratch_size or self.run.profile_scratch_size)))
        return real_getitem(self, grid)

    monkeypatch.setattr(CompiledKernel, "__getitem__", runner_getitem)
    per_call, packed_per_call, runner_per_call = [], [], []
    for inputs in ("aligned", "aligned", "misaligned"):
        q, k, v = make_qkv(*shape, torch.bfloat16, "cuda", requires_grad=True)
        dout = torch.randn_like(q)
        if inputs == "misaligned":  # dO too: it is all the preprocessing kernel reads besides O
            q, k, v, dout = (misaligned_like(t) for t in (q, k, v, dout))
            assert not tma_compatible(q)
        before, packed_before = dict(counts), {**packed_counts, **{f"bwd_{k}": n for k, n in packed_bwd_counts.items()}}
        runner_launches.clear()
        out = flash_attn_func(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        per_call.append({key: counts[key] - before[key] for key in counts})
        packed_per_call.append({**{key: packed_counts[key] - packed_before[key] for key in packed_counts},
                                **{f"bwd_{key}": packed_bwd_counts[key] - packed_before[f"bwd_{key}"]
                                   for key in packed_bwd_counts}})
        runner_per_call.append(list(runner_launches))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_out, _ = attention_reference(q64, k64, v64, causal=causal)
        ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
        same_out = attention_same_dtype(q, k, v, causal=causal)
        same_grads = torch.autograd.grad(same_out, (q, k, v), dout)
        assert_close_to_reference("out", out, ref_out, same_out)
        for name, g, ref, same in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads):
            assert_close_to_reference(name, g, ref, same)
    first, second, misaligned = per_call
    packed_first, packed_second, _ = packed_per_call
    # the second call runs its shape's plan: each kernel's compiled kernel launched directly, not even
    # through the CachedLauncher (launch.DirectLaunch), the varlen Gluon kernels' too. Misaligned
    # inputs are another plan (their alignment is in its key), which also changes the path constexprs
    # of the forward, dK/dV and dQ launches (no TMA, no Gluon kernel), so every launch goes through
    # the JIT again
    assert first["all"] + packed_first["all"] + packed_first["bwd_all"] >= 3, (first, packed_first)
    assert first["jit"] == first["all"] and packed_first["jit"] == packed_first["all"], (first, packed_first)
    assert packed_first["bwd_jit"] == packed_first["bwd_all"], packed_first
    # a packed backward launches its preprocess kernel through the CachedLauncher too (no plan)
    unplanned = 1 if packed_first["bwd_all"] else 0
    assert second == {"all": unplanned, "jit": 0}, "the second call did not launch its plan's compiled kernels"
    assert packed_second == {"all": 0, "jit": 0, "bwd_all": 0, "bwd_jit": 0}, \
        f"the second call did not launch the varlen plans' compiled kernels: {packed_second}"
    # ... and each through Triton's C launcher (launch.DirectLaunch's C path) unless it needs scratch
    # (the in-kernel descriptors of the Triton kernels at head dim 256)
    assert [name for name, scratch in runner_per_call[1] if not scratch] == [], \
        f"launched through the Python runner without needing it: {runner_per_call[1]}"
    assert misaligned["all"] >= 3 and misaligned["jit"] == misaligned["all"], \
        "misaligned inputs took a launch compiled for aligned ones"


def test_descriptor_expansion_passes_what_tritons_own_descriptor_wrapper_passes(monkeypatch):
    """launch.descriptor_expansion (a plan's descriptors encoded without Triton's per-launch Python)
    gives Triton 3.6's C launcher the arguments its wrap_handle_tensordesc would: each descriptor as
    make_tensordesc_arg expands it (the encoding of the tensor's address, then shape and strides), the
    other arguments as they are. The encoder is a stand-in that records its inputs (CPU: no driver)."""
    import types

    from triton.backends.nvidia import driver as nvidia_driver
    from triton.runtime import driver

    from kernels.launch import descriptor_expansion

    def fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding):
        return ("tensormap", address, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides),
                padding)

    monkeypatch.setattr(driver, "_active", types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill)))
    received = []
    signature = {"a_desc": "tensordesc<bf16[64,128]>", "n": "i32", "b_desc": "tensordesc<fp32[64,64]>",
                 "X": "*fp32", "scale": "fp32", "BLOCK": "constexpr"}
    metas = [{"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [64, 128], "fp4_padded": False},
             {"swizzle": 2, "elem_size": 4, "elem_type": 7, "block_size": [64, 64], "fp4_padded": False}]
    wrapped = nvidia_driver.wrap_handle_tensordesc(lambda *args: received.append(args), signature, metas)
    a, b, x = torch.randn(256, 128), torch.randn(512, 64), torch.randn(8)
    templates = {0: descriptor_template(TensorDescriptor(a, [256, 128], [128, 1], [64, 128])),
                 2: descriptor_template(TensorDescriptor(b, [512, 64], [64, 1], [64, 64], padding="nan"))}
    launch_head = tuple(range(nvidia_driver._BASE_ARGS_FORMAT_LEN))  # grid, stream, function, flags, ...
    wrapped(*launch_head, descriptor_like(templates[0], a), 7, descriptor_like(templates[2], b), x, 0.5, 16)
    raw, expand = descriptor_expansion(wrapped, templates, (fill, nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST))
    raw(*launch_head, *expand((a, 7, b, x, 0.5)), 16)
    assert len(received) == 2 and received[0] == received[1]
    assert received[1][len(launch_head)][:2] == ("tensormap", a.data_ptr()) and received[1][-1] == 16
    # positions the wrapper encodes but the plan did not template: no expansion (the descriptors' path)
    assert descriptor_expansion(wrapped, {0: templates[0]}, (fill, nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST)) is None
    assert descriptor_expansion(lambda *args: None, templates, (fill, {})) is None  # not a wrapper
    assert descriptor_expansion(wrapped, templates, None) is None  # no encoder here


def test_a_direct_launch_makes_the_templated_descriptors_on_the_jit_path():
    """A plan passes tensors where its DirectLaunch holds descriptor templates: a launcher that is
    not the compiled kernel's C path (a test's, an experiment's) receives the descriptors."""
    holder = LauncherHolder()
    spied = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: spied.append(args)

    holder.launcher = Spy()
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    template = descriptor_template(TensorDescriptor(a, [64, 32], [32, 1], [16, 32]))
    direct = DirectLaunch(holder, "launcher", (4,), {"BLOCK": 16}, descriptors={0: template})
    direct(b, 64, 0.5)
    (desc, n, scale), = spied
    assert isinstance(desc, TensorDescriptor) and desc.base is b and desc.block_shape == [16, 32]
    assert (n, scale) == (64, 0.5)


def test_without_a_tma_encoder_the_reason_is_kept():
    """launch.TMA_ENCODE is Triton's host TMA encoder, or None with the reason it is not there
    (no CUDA driver here on CPU): the plans then take Triton's own descriptor path, and why is
    readable, not swallowed."""
    from kernels import launch as launch_module

    assert (launch_module.TMA_ENCODE is None) == bool(launch_module.TMA_ENCODE_UNAVAILABLE)
    if launch_module.TMA_ENCODE is None:
        assert ":" in launch_module.TMA_ENCODE_UNAVAILABLE  # 'ExceptionType: message'


def test_a_missing_tma_encoder_is_warned_once_with_its_reason(monkeypatch):
    """Where there is no host TMA encoder, the first plan with host descriptors says so (once per
    process, the reason included) rather than taking the slower host path unseen."""
    import warnings

    from kernels import launch as launch_module

    monkeypatch.setattr(launch_module, "TMA_ENCODE_UNAVAILABLE", "ImportError: no driver")
    monkeypatch.setattr(launch_module, "_WARNED_NO_TMA_ENCODER", [])
    with pytest.warns(RuntimeWarning, match="no host TMA encoder.*ImportError: no driver"):
        launch_module.warn_no_tma_encoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch_module.warn_no_tma_encoder()  # the second plan: no warning
