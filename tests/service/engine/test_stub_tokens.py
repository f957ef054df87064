"""`stub_tokens`: a stub sample's tokens, (7 p + key) % vocab_size at position p, sliced from a table of the
vocabulary's ids (service/engine/stub_engine.py) instead of computed token by token."""

import random

from das.service.engine.stub_engine import stub_tokens


def test_the_tokens_follow_the_formula_across_the_vocabularys_wrap_and_any_span() -> None:
    draw = random.Random(0)
    # a longer span after shorter ones grows the table; 7 divides one vocabulary size (its ids repeat sooner)
    for vocab_size in (2, 7, 64, 32000, 151936):
        for stop in (0, 1, 5, 300, 4096, 9000):
            key = draw.randrange(2**63)
            start = draw.randrange(stop + 1)
            assert stub_tokens(key, start, stop, vocab_size) == [(7 * p + key) % vocab_size
                                                                for p in range(start, stop)]


def test_each_sample_gets_a_list_of_its_own() -> None:
    first = stub_tokens(3, 0, 4, 32000)
    first.append(99)
    assert stub_tokens(3, 0, 4, 32000) == [3, 10, 17, 24]
