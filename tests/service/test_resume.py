"""Resume, not restart (service/cluster/engine_failure.py `Share`, the stub engine's prefix): a sample an engine lost
runs again from the tokens it had delivered and comes out as the undisturbed sample, logprobs and weight spans
included. The death itself, through Ray, is in test_engine_failure.py."""

from __future__ import annotations

import asyncio

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.cluster.engine_failure import Share
from das.service.wire.api import GroupRequest, SampleResult
from das.service.wire.sample_progress import ProgressBatcher, SampleProgress


def run(engine: StubEngine, group: GroupRequest) -> tuple[list[SampleResult], list[SampleProgress]]:
    reports: list[SampleProgress] = []

    async def go() -> list[SampleResult]:
        return [s async for s in engine.generate(group, reports.append)]

    return asyncio.run(go()), reports


GROUP = GroupRequest(problem_id="p", n=3, prompt_token_ids=(1, 2, 3), sampling={"max_tokens": 20, "seed": 5})


def test_the_stub_reports_every_token_but_the_last_contiguously():
    samples, reports = run(StubEngine(StubEngineConfig(tokens=6)), GROUP)
    for sample in samples:
        mine = [r for r in reports if r.sample_index == sample.sample_index]
        # each report follows on from the one before (unpaced, the stub makes a sample's tokens in one step)
        assert [r.offset for r in mine] == [sum(len(r.token_ids) for r in mine[:i]) for i in range(len(mine))]
        assert [t for r in mine for t in r.token_ids] == sample.token_ids[:5]


def test_a_share_resumes_its_lost_samples_from_what_they_delivered_and_stitches_them_back():
    engine = StubEngine(StubEngineConfig(tokens=12))
    (undisturbed, _) = run(engine, GROUP)
    by_index = {s.sample_index: s for s in undisturbed}

    share = Share(0, (0, 1, 2))
    assert share.request(GROUP) is GROUP  # nothing delivered yet: the group as it is
    # The first engine delivered 7 tokens of sample 1 (two reports, at policy version 0 then 1) and 3 of sample 2,
    # and sample 0 whole; then it died.
    first = share.progress(SampleProgress(1, 0, by_index[1].token_ids[:4], [-0.1] * 4, "", 0))
    assert first is not None and first.sample_index == 1
    share.progress(SampleProgress(1, 4, by_index[1].token_ids[4:7], [-0.2] * 3, "", 1))
    share.progress(SampleProgress(2, 0, by_index[2].token_ids[:3], [-0.3] * 3, "", 1))
    assert share.progress(SampleProgress(2, 1, [9], [0.0], "", 1)) is None  # does not follow on: dropped
    assert share.take(by_index[0].model_copy()) is not None
    rest = share.remainder("node/0", 100.0)
    assert rest is not None and rest.indices == (1, 2)

    request = rest.request(GROUP)
    assert request.n == 2 and request.key_indices == (1, 2)
    assert request.prefix_token_ids == (tuple(by_index[1].token_ids[:7]), tuple(by_index[2].token_ids[:3]))
    engine.policy_version = 1
    resumed, reports = run(engine, request)
    assert all(r.offset >= 3 for r in reports)  # the new engine starts after what was delivered
    for sample in resumed:
        taken = rest.take(sample)
        assert taken is not None
        assert taken.token_ids == by_index[taken.sample_index].token_ids  # the same draw as undisturbed
        assert len(taken.logprobs) == 12
    stitched = {s.sample_index: s for s in resumed}
    assert stitched[1].logprobs[:7] == [-0.1] * 4 + [-0.2] * 3  # the delivered tokens' logprobs kept
    assert stitched[1].policy_version == 0 and stitched[1].policy_spans == [(0, 0), (1, 4)]
    assert stitched[2].policy_version == 1 and stitched[2].policy_spans is None  # one version throughout


def test_the_batcher_merges_a_samples_reports_and_forgets_a_finished_one():
    batcher = ProgressBatcher()
    batcher.add("a", SampleProgress(0, 0, [1, 2], [0.0, 0.0], "x"))
    batcher.add("a", SampleProgress(0, 2, [3], [0.0], "y"))
    batcher.add("b", SampleProgress(1, 0, [4], [0.0]))
    batcher.drop("b")
    ((key, merged),) = batcher.take()
    assert key == "a" and merged.token_ids == [1, 2, 3] and merged.text == "xy" and batcher.take() == []
