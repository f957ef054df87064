"""`ResumeSeam`: what an engine needs to continue a sample from the tokens it had delivered before its engine died
(GroupRequest.prefix_token_ids) so that it comes out as the undisturbed sample would.

vLLM runs the continuation with prompt + prefix as its prompt and knows nothing of the prefix as output: its stop
strings are searched in the new text only, and its text has no prefix. So for a resumed sample the engine checks the
seam itself while the first new tokens come (`stop_in`: a stop string that began in the prefix and ends in the new
tokens ends the sample there, as it would have in one piece), and detokenizes the whole output once at the end
(`text`: prefix + new tokens, cut before the first stop string, as vLLM cuts it). A prefix whose last token already
ended the sample (EOS or a stop token id; its result was lost with the engine) is finished without running.
"""

from __future__ import annotations

from typing import Any

from das.service.wire.api import SamplingSpec

# Prefix tokens decoded with the new ones to find a stop string across the seam: a stop string is at most this many
# tokens long in practice (each token one character or more; stop strings are short).
_SEAM_TOKENS = 32


class ResumeSeam:
    """The seam of one resumed sample: `prefix` (its delivered output tokens), its sampling, the tokenizer (None:
    no text, no stop strings: the stub)."""

    def __init__(self, tokenizer: Any, prefix: list[int], sampling: SamplingSpec) -> None:
        self._tokenizer = tokenizer
        self._prefix = prefix
        self._sampling = sampling
        self._stops = list(sampling.stop) if tokenizer is not None else []
        self._tail = prefix[-_SEAM_TOKENS:]
        self._tail_chars = len(self._decode(self._tail)) if self._stops else 0
        self._window = max((len(s) for s in self._stops), default=0)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True))

    def ended_in_prefix(self, eos_token_ids: set[int]) -> bool:
        """Whether the prefix's last token ended the sample (EOS unless ignore_eos, or a stop token id)."""
        last = self._prefix[-1]
        return last in self._sampling.stop_token_ids or (not self._sampling.ignore_eos and last in eos_token_ids)

    def stop_in(self, before: list[int], new: list[int]) -> int | None:
        """After the new tokens `before` came, `new` arrives: the count of `new` tokens up to the one that completes
        a stop string begun in the prefix (that token included, as vLLM keeps it), or None."""
        if not self._stops or len(before) >= self._window:
            return None  # past the seam: a stop string now lies in the new text, which vLLM searches itself
        for count in range(1, len(new) + 1):
            text = self._decode(self._tail + before + new[:count])
            for stop in self._stops:
                at = text.find(stop, max(0, self._tail_chars - len(stop) + 1))
                if 0 <= at < self._tail_chars:
                    return count
        return None

    def text(self, new: list[int]) -> str | None:
        """The sample's whole text (prefix + new tokens), cut before its first stop string; None without a
        tokenizer."""
        if self._tokenizer is None:
            return None
        text = self._decode(self._prefix + new)
        cuts = [at for stop in self._stops if (at := text.find(stop)) >= 0]
        return text[:min(cuts)] if cuts else text
