"""Where a run computes: the device a config names, the precision it computes in there
(:func:`uses_bf16`), the CUDA attention kernels it keeps to, ``torch.compile`` checked and
applied, and host batches moved to the device."""

from __future__ import annotations

import sys

import torch

from mtbert.core.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is available", key="device")
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available()
                          else "cpu" if name == "auto" else name)
    if device.type == "cuda":
        prefer_stable_attention_kernels()
    return device


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and what torch reports of it: a CUDA
    GPU with bf16 (Ampere and later); a CPU whose ATen kernels run AVX-512 and that has
    AVX-512 BF16 or AMX tiles (elsewhere bf16 matmuls are emulated, slower than float32)."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"CUDA {'with' if ok else 'without'} native bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    units = [name for name, has in (("AVX-512 BF16", torch.cpu._is_avx512_bf16_supported()),
                                    ("AMX", torch.cpu._is_amx_tile_supported())) if has]
    ok = capability.startswith("AVX512") and bool(units)
    return ok, f"CPU kernels {capability}" + (f", {' and '.join(units)}" if units else
                                               ", no AVX-512 BF16 or AMX")


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether a run of ``precision`` (auto | fp32 | bf16) autocasts to bfloat16 on
    ``device``: auto where the device computes bf16 natively, fp32 never; bf16 asked where
    it does not is a ConfigError (key ``precision``)."""
    if precision == "fp32":
        return False
    native, what = native_bf16(device)
    if precision == "bf16" and not native:
        raise ConfigError(f"precision=bf16 but this device does not compute bfloat16 natively "
                          f"({what}); use precision=auto or fp32", key="precision")
    return native


def precision_line(precision: str, device: torch.device) -> str:
    """``precision auto: bf16 (CPU kernels AVX512, AVX-512 BF16 and AMX)``: what a run of
    ``precision`` computes in on ``device``, and why."""
    return (f"precision {precision}: {'bf16' if uses_bf16(precision, device) else 'fp32'} "
            f"({native_bf16(device)[1]})")


def prefer_stable_attention_kernels() -> None:
    """Keep cuDNN's scaled-dot-product attention out of the SDPA dispatch: it builds a new
    execution plan for every new (batch, padded length) shape, where the flash and
    memory-efficient kernels SDPA then uses need none (docs/training.md). Process-wide."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def check_step_mode(mode: str, device: torch.device) -> None:
    """ConfigError (key ``step_mode``) for ``step_mode=graphs`` off CUDA."""
    if mode == "graphs" and device.type != "cuda":
        raise ConfigError(f"step_mode=graphs needs a CUDA device; the device is "
                          f"{device.type} (use step_mode=auto or eager)", key="step_mode")


def check_compile_mode(mode: str, device: torch.device) -> None:
    """ConfigError (key ``compile``) when ``device`` cannot run ``compile=mode``."""
    if mode == "none":
        return
    if mode == "reduce-overhead" and device.type != "cuda":
        raise ConfigError(f"compile=reduce-overhead records CUDA graphs and needs a CUDA device; "
                          f"the device is {device.type} (use compile=default or none)", key="compile")
    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(f"compile={mode}: torch.compile does not support this Python "
                          f"({sys.version.split()[0]}); use compile=none", key="compile")
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise ConfigError(f"compile={mode} on CUDA needs triton (not installed); use "
                              "compile=none", key="compile")
    else:
        from torch._inductor import cpp_builder
        try:
            cpp_builder.get_cpp_compiler()
        except Exception:  # inductor's CPU kernels are C++: no compiler, no compile
            raise ConfigError(f"compile={mode} on the CPU needs a C++ compiler (g++ or clang++) "
                              "on PATH; use compile=none", key="compile") from None


def compile_model(model: torch.nn.Module, mode: str) -> None:
    """``torch.compile`` the model in place (``nn.Module.compile``: its state_dict keys stay
    the same). Static shapes: one graph per (task, batch shape, train/eval, SMART inputs),
    which ``pad_lengths=buckets`` keeps to a few dozen."""
    if mode == "none":
        return
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 1024)
    model.compile(mode=mode, dynamic=False)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A host batch on ``device``; to CUDA from pinned memory without blocking the host
    (the copy queues behind the GPU's work like a kernel)."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
