"""Liger-Kernel's Llama patch, applied for the duration of one baseline run.

Shared by benches/pytorch_baseline.py (one GPU) and benches/pytorch_ddp_baseline.py (DDP). The
wheel travels to the GPU machine (it has no network); without it the runs that need it print a
JSON line saying so instead of a figure.
"""
import contextlib
from importlib.metadata import version


@contextlib.contextmanager
def liger_llama():
    """Liger-Kernel's Llama patch for the duration of one mode. apply_liger_kernel_to_llama
    rebinds names in transformers' modeling_llama module (the RoPE function is looked up there at
    every call, LlamaForCausalLM.forward is replaced), so the patch must hold while the model
    runs and be undone afterwards, or the modes after it would silently run Liger too."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    saved_names = dict(vars(modeling_llama))
    saved_forward = vars(modeling_llama.LlamaForCausalLM)["forward"]
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True)
    try:
        yield
    finally:
        modeling_llama.LlamaForCausalLM.forward = saved_forward
        for name, value in saved_names.items():
            if vars(modeling_llama).get(name) is not value:
                setattr(modeling_llama, name, value)


def liger_version():
    """The installed liger_kernel's version, or an error string when it cannot be imported."""
    try:
        import liger_kernel.transformers  # noqa: F401
        return version("liger-kernel"), None
    except Exception as e:  # noqa: BLE001 — any import failure means "no Liger run"
        return None, f"liger_kernel not importable: {type(e).__name__}: {e}"
