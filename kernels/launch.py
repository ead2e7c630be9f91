"""Launching a Triton kernel without Triton's per-call argument binding, once it has run.

`kernel[grid](*args, **kwargs)` binds every argument to the kernel's signature, computes its
specialisation (a tensor's dtype and 16-byte alignment, an int's size class and whether it is
1 or a multiple of 16), hashes that into a cache key, looks the compiled kernel up, then
launches it. On the H200 machine's host a whole launch took 37-144 us, four of them in a
forward+backward whose host time (0.5-0.95 ms at seqlen 512) is about its GPU time. Launching
the `CompiledKernel` that call returned (`compiled[grid](*args)`) skips the binding and the
lookup: 2-18 us less per launch, 20-39 us per forward+backward (docs/performance.md,
"Cached launches"); the launch itself still costs 35-77 us there. Where no launch hook is set,
a kept kernel is launched by Triton's C launcher itself (`no_launch_hooks`, DirectLaunch),
skipping the compiled kernel's Python runner too.

`CachedLauncher` keeps that kernel under a key computed from the arguments that determines
Triton's specialisation, and more finely: each tensor's dtype and alignment, each int's and
bool's type and value (a shape or stride), each constexpr and launch option, each host-made
tensor descriptor's tensor (as above), shape, strides, block shape and layout, the device, and
the debug and instrumentation knobs that Triton's own key holds. A key seen before launches its
compiled kernel directly; any other call goes through the JIT (which compiles where needed),
and its result is kept. Float arguments (the softmax scale) are not specialised by Triton and
are not in the key.

Always through the JIT: under TRITON_INTERPRET=1 (there is no compiled kernel), a grid function,
and a kernel with pre-run hooks (which run at every JIT launch).
"""
from __future__ import annotations

import os
import warnings

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_KEYS = 1024  # per kernel; the cache is emptied when full (a new shape per call never hits)


def _arg_key(arg):
    """What of one launch argument Triton's specialisation can depend on (or more)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float
    if isinstance(arg, (TensorDescriptor, GluonTensorDescriptor)):  # host-made TMA descriptors
        return (type(arg), arg.base.dtype, arg.base.data_ptr() % 16 == 0, tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape), getattr(arg, "layout", None), arg.padding)
    # int, bool, None: the type (True == 1) and the value; an unhashable object makes the call uncached
    return type(arg), arg


class CachedLauncher:
    """`launcher[grid](*args, **kwargs)` launches `kernel` like `kernel[grid](*args, **kwargs)`.

    The positional arguments are the kernel's leading parameters; the keyword arguments are
    the remaining parameters (all of them: defaults are not filled in) and launch options
    (num_warps, num_stages)."""

    def __init__(self, kernel):
        self.kernel = kernel
        # key -> (compiled kernel, its trailing parameters' names, its C launch or None: _c_launch)
        self.compiled: dict[tuple, tuple[CompiledKernel, tuple[str, ...], tuple | None]] = {}
        self.interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if self.interpreted or callable(grid) or getattr(self.kernel, "pre_run_hooks", None):
            return self.kernel[grid](*args, **kwargs)
        key = (torch.cuda.current_device(), knobs.runtime.debug, knobs.compilation.instrumentation_mode,
               *((name, _arg_key(value)) for name, value in kwargs.items()), *map(_arg_key, args))
        try:
            hit = self.compiled.get(key)
        except TypeError:  # an argument this key cannot describe: always through the JIT
            return self.kernel[grid](*args, **kwargs)
        if hit is not None:
            compiled, trailing, fast = hit
            # a 3D grid (the JIT pads it; a compiled kernel's launch does not), then the signature's
            # remaining parameters in order (constexprs are passed too and ignored)
            grid3 = (*grid, 1, 1)[:3]
            if fast is not None and no_launch_hooks():  # Triton's C launcher, as DirectLaunch
                _c_call(fast, grid3, (*args, *(kwargs[name] for name in trailing)))
                return compiled
            compiled[grid3](*args, *(kwargs[name] for name in trailing))
            return compiled
        compiled = self.kernel[grid](*args, **kwargs)  # binds, specialises, compiles if needed
        trailing = tuple(self.kernel.arg_names[len(args):])
        if isinstance(compiled, CompiledKernel) and set(trailing) <= kwargs.keys():
            if len(self.compiled) >= MAX_KEYS:
                self.compiled.clear()
            self.compiled[key] = compiled, trailing, _c_launch(compiled)
        return compiled


class DirectLaunch:
    """One launch site of a per-shape call plan (forward.py, backward.py): the first call goes
    through `getattr(module, name)` (a CachedLauncher, or whatever a test put there) and keeps
    the CompiledKernel it returns; later calls launch that kernel directly with the launch's
    constexprs bound, skipping even CachedLauncher's per-argument key, as long as the module
    still holds the same launcher. The plan's own key (shapes, strides, dtypes, alignment,
    config) fixes every specialisation the kernel depends on.

    Where the kernel needs no global or profiling scratch and no launch hook is set (a
    profiler's: `no_launch_hooks`), the launch calls Triton's C launcher itself, as
    CompiledKernel's runner and CudaLauncher.__call__ would after their Python steps (Triton 3.6's
    launcher arguments: grid, stream, function, cooperative and PDL flags, the two scratch
    buffers, packed metadata, launch metadata, the two hooks, then the kernel's arguments; with no
    hook set, no launch metadata and None for both hooks)."""

    __slots__ = ("compiled", "descriptors", "expand", "fast", "grid", "grid3", "kwargs", "launcher", "module", "name",
                 "trailing")

    def __init__(self, module, name: str, grid: tuple, kwargs: dict, descriptors: dict | None = None):
        self.module, self.name, self.grid, self.kwargs = module, name, grid, kwargs
        self.grid3 = (*grid, 1, 1)[:3]
        self.launcher = self.compiled = self.fast = self.expand = None
        self.trailing: tuple = ()
        # argument position -> host descriptor template (descriptor_template): the caller passes the
        # tensor there, and the launch makes the descriptor (or, on the C path, its encoding) itself
        self.descriptors = descriptors or {}

    def __call__(self, *args):
        launcher = getattr(self.module, self.name)
        if self.compiled is not None and launcher is self.launcher:
            if self.fast is not None and no_launch_hooks():
                if self.expand is not None:
                    raw, expand = self.expand  # Triton's C launcher itself, and the expansion
                    _c_call((raw, *self.fast[1:]), self.grid3, (*expand(args), *self.trailing))
                else:  # no host TMA encoder: descriptors made here, expanded by Triton's wrapper
                    _c_call(self.fast, self.grid3, (*self._described(args), *self.trailing))
                return self.compiled
            return self.compiled[self.grid3](*self._described(args), *self.trailing)
        args = self._described(args)
        result = launcher[self.grid](*args, **self.kwargs)
        if isinstance(launcher, CachedLauncher) and isinstance(result, CompiledKernel):
            names = launcher.kernel.arg_names[len(args):]
            if set(names) <= self.kwargs.keys():
                self.launcher, self.compiled = launcher, result
                self.trailing = tuple(self.kwargs[name] for name in names)
                self.fast = _c_launch(result)
                if self.fast is not None and self.descriptors:
                    # (Triton's C launcher, expand), or None: Triton's wrapper expands the descriptors
                    self.expand = descriptor_expansion(self.fast[0], self.descriptors, TMA_ENCODE)
                    if TMA_ENCODE is None:
                        warn_no_tma_encoder()
        return result

    def _described(self, args: tuple) -> tuple:
        """`args` with each templated position's tensor made a descriptor (descriptor_like)."""
        if not self.descriptors:
            return args
        return tuple(descriptor_like(self.descriptors[i], arg) if i in self.descriptors else arg
                     for i, arg in enumerate(args))


def _tma_encoder():
    """(Triton 3.6's host TMA encoding (CUDA driver utils: fill_tma_descriptor) and its dtype codes,
    None), or (None, why) where they are not there (no CUDA driver, another Triton): the plans then
    pass descriptors through Triton's own wrapper, as correct and slower on the host."""
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
        from triton.runtime import driver

        return (driver.active.utils.fill_tma_descriptor, TMA_DTYPE_DEVICE_TO_HOST), None
    except Exception as exc:  # noqa: BLE001 -- any failure: the descriptors' own path, its reason kept
        return None, f"{type(exc).__name__}: {exc}"[:300]


# Triton's launcher of a kernel with host-made descriptors encodes each one in Python at every launch
# (driver.py's wrap_handle_tensordesc and make_tensordesc_arg: a Python descriptor object, then a list
# of its fields, its shape and strides, then the C encoding). A plan's launch encodes the tensors'
# addresses itself instead (descriptor_expansion), where Triton's host TMA encoder is there.
TMA_ENCODE, TMA_ENCODE_UNAVAILABLE = _tma_encoder()  # the reason, where there is no encoder
_WARNED_NO_TMA_ENCODER = []


def warn_no_tma_encoder() -> None:
    """Warn once per process that a plan's host descriptors go through Triton's own wrapper (correct,
    slower on the host) because there is no host TMA encoder, and why (TMA_ENCODE_UNAVAILABLE)."""
    if not _WARNED_NO_TMA_ENCODER:
        _WARNED_NO_TMA_ENCODER.append(True)
        warnings.warn("kernels: no host TMA encoder, so the Gluon plans' descriptors take Triton's own "
                      f"(slower) host path: {TMA_ENCODE_UNAVAILABLE}", RuntimeWarning, stacklevel=3)


def descriptor_expansion(wrapped, descriptors: dict, encoder):
    """(Triton's C launcher, expand) for a launcher wrapped by Triton 3.6's wrap_handle_tensordesc,
    or None where it cannot be done as that wrapper would: `expand(args)` turns the call's leading
    arguments, tensors at the templated positions, into the C launcher's kernel arguments, each
    descriptor as make_tensordesc_arg gives it (the encoding of the tensor's address with the
    template's shape, strides, padding and the compiled kernel's block, swizzle and element type,
    then its shape and strides). Only the address differs between calls of a plan."""
    if encoder is None:
        return None
    fill, dtype_codes = encoder
    cells = dict(zip(getattr(getattr(wrapped, "__code__", None), "co_freevars", ()),
                     (cell.cell_contents for cell in getattr(wrapped, "__closure__", None) or ())))
    raw, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
    if raw is None or indices is None or not metas or sorted(indices) != sorted(descriptors) or any(
            meta is None or meta.get("fp4_padded") for meta in metas):
        return None
    specs = []
    for position, meta in zip(sorted(indices), metas):  # the wrapper's order: by position
        template = descriptors[position]
        shape, strides = list(template.shape), list(template.strides)
        specs.append((position, meta["swizzle"], meta["elem_size"], dtype_codes[meta["elem_type"]], meta["block_size"],
                      shape, strides, 1 if template.padding == "nan" else 0, (*shape, *strides)))

    def expand(args):
        out, start = [], 0
        for position, swizzle, elem_size, elem_type, block, shape, strides, padding, tail in specs:
            out.extend(args[start:position])
            out.append(fill(args[position].data_ptr(), swizzle, elem_size, elem_type, block, shape, strides, padding))
            out.extend(tail)
            start = position + 1
        out.extend(args[start:])
        return out

    return raw, expand


def no_launch_hooks() -> bool:
    """Whether no launch hook (a profiler's) is set. Triton 3.6 keeps each kind as a HookChain,
    never None (its own runner therefore builds launch metadata and calls both chains at every
    launch): none is set while both chains are empty. An older Triton's hook is None or a function."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (exit_ is None or not getattr(exit_, "calls", True))


def _c_call(fast: tuple, grid3: tuple, kernel_args: tuple) -> None:
    """Launch through Triton's C launcher with no launch metadata and no hooks (`no_launch_hooks`
    holds): `fast` as `_c_launch` gives it, on the current stream."""
    launch, function, cooperative, pdl, packed = fast
    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    launch(*grid3, stream, function, cooperative, pdl, None, None, packed, None, None, None, *kernel_args)


def _c_launch(compiled: CompiledKernel):
    """(C launch function, CUfunction, cooperative, PDL, packed metadata) of a compiled kernel that
    needs no scratch buffers, or None (then its own runner launches it)."""
    run = getattr(compiled, "run", None)  # loads the module on first use
    fields = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if not all(hasattr(run, field) for field in fields) or not hasattr(compiled, "packed_metadata"):
        return None
    if run.global_scratch_size or run.profile_scratch_size:
        return None
    return run.launch, compiled.function, run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata


def descriptor_template(descriptor):
    """`descriptor` without its tensor, for a plan to keep: a plan made during a CUDA-graph
    pool's warm-up (torch.compile's "reduce-overhead") must not keep that call's tensors alive,
    or the pool finds allocations that are not the graph's outputs."""
    template = object.__new__(type(descriptor))
    template.__dict__.update(descriptor.__dict__)
    template.base = None
    return template


def descriptor_like(template, base: torch.Tensor):
    """A host tensor descriptor equal to `template` but for its base tensor, without the
    constructor's validation: the caller's plan key guarantees `base` has the template base's
    shape, strides, dtype and 16-byte alignment."""
    descriptor = object.__new__(type(template))
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = base
    return descriptor


class PlanCache(dict):
    """Per-shape call plans, emptied when full (a new shape per call never hits)."""

    def put(self, key, plan):
        if len(self) >= MAX_KEYS:
            self.clear()
        self[key] = plan
        return plan
