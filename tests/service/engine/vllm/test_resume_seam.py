"""The seam of a resumed sample (service/engine/vllm/resume_seam.py), with a tokenizer of one character a token."""

from __future__ import annotations

from das.service.engine.vllm.resume_seam import ResumeSeam
from das.service.wire.api import SamplingSpec


class Chars:
    """Token id i is chr(i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_stop_string_that_began_in_the_prefix_ends_the_sample_at_the_token_completing_it():
    seam = ResumeSeam(Chars(), ids("the answer is 4 ST"), SamplingSpec(stop=("STOP",), max_tokens=64))
    assert seam.stop_in([], ids("Ox")) is None  # "STO": not yet
    assert seam.stop_in(ids("O"), ids("Px y")) == 1  # "P" completes "STOP": kept, as vLLM keeps that token
    assert seam.text(ids("OP")) == "the answer is 4 "  # cut before the stop string, as vLLM cuts it
    plain = ResumeSeam(Chars(), ids("the answer"), SamplingSpec(stop=("STOP",), max_tokens=64))
    assert plain.stop_in([], ids(" is")) is None and plain.text(ids(" is 4")) == "the answer is 4"
    assert plain.stop_in(ids(" is 4 and more"), ids("STOP")) is None  # past the seam: vLLM's own search


def test_a_prefix_ending_in_eos_or_a_stop_token_is_finished_without_running():
    assert ResumeSeam(None, [5, 2], SamplingSpec(max_tokens=8)).ended_in_prefix({2})
    assert not ResumeSeam(None, [5, 2], SamplingSpec(max_tokens=8, ignore_eos=True)).ended_in_prefix({2})
    assert ResumeSeam(None, [5, 9], SamplingSpec(max_tokens=8, stop_token_ids=(9,))).ended_in_prefix({2})
    assert ResumeSeam(None, [5, 2], SamplingSpec(max_tokens=8)).text([3]) is None  # no tokenizer, no text
