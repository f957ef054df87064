"""A DAS proposer set up without an engine (`make_proposer`) and the prompt and response its tests draft from."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from das.service.engine.vllm.proposer import DasProposer


PROMPT = [7, 8, 9]
RESPONSE = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
STEP_S = 0.01  # each proposal is one engine step this long, whatever it verified: drafts are free on this clock


def make_proposer(k: int = 4, vocab: int = 100, max_model_len: int = 64, budget: dict | None = None,
                  drafter: dict | None = None) -> DasProposer:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab, max_model_len=max_model_len),
        additional_config={"das": {"budget": budget or {}, "drafter": drafter or {}}})
    proposer = DasProposer(config)
    # a steady step clock: the cost fit and the guard see the same steps on a loaded machine as on a quiet one
    proposer.clock = itertools.count(0.0, STEP_S).__next__
    return proposer
