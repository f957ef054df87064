"""`das rollout`: a multi-epoch RL-style run against a rollout server, as a trainer would drive it.

Every epoch sends the same problems (n samples each) as one batch through `RolloutClient`, shows a progress bar
as samples stream back, and measures the batch's makespan (request sent to last sample received, seconds, at
the client). All samples of all epochs are written as a history file (drafter/records.py format), ready for
`POST /v1/history`, `das history stats` or `das bench drafter`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from das.drafter.records import RolloutRecord, write_rollouts
from das.service.client import RolloutClient
from das.service.client.prompt_sets import Problem
from das.service.wire.api import SamplingSpec, seeded_groups
from das.service.wire.sample_keys import derive


@dataclass(frozen=True)
class EpochFigures:
    epoch: int
    makespan_s: float
    samples: int
    output_tokens: int
    draft_tokens: int
    accepted_tokens: int
    errors: int
    policy_versions: list[int]
    longest_tokens: int = 0  # the longest sample's output tokens: at T > 0 the makespan follows it
    # The most decode steps any sample took (its output tokens less its accepted draft tokens): the batch's critical
    # path in engine steps, which speculation shortens where it drafts for the stragglers.
    critical_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def seconds_per_longest_token(self) -> float:
        """Makespan over the longest sample's length: comparable across runs that drew different stragglers."""
        return self.makespan_s / self.longest_tokens if self.longest_tokens else 0.0

    @property
    def seconds_per_critical_step(self) -> float:
        """Makespan over the critical path's steps: the time an engine step took along it. Equal in two arms, a
        makespan gap is the steps speculation saved; unequal, the arms' steps cost differently."""
        return self.makespan_s / self.critical_steps if self.critical_steps else 0.0


@dataclass(frozen=True)
class RolloutRun:
    epochs: list[EpochFigures]
    history_file: str | None
    records: int

    def to_dict(self) -> dict[str, Any]:
        return {"epochs": [{**asdict(e), "tokens_per_s": e.tokens_per_s,
                            "seconds_per_longest_token": e.seconds_per_longest_token,
                            "seconds_per_critical_step": e.seconds_per_critical_step} for e in self.epochs],
                "history_file": self.history_file, "records": self.records}

    def print(self, console: Console) -> None:
        table = Table(title="das rollout: makespan per epoch (client-side)")
        for column in ("epoch", "makespan s", "samples", "tokens", "tokens/s", "longest", "critical steps",
                       "drafted", "accepted", "errors", "policy"):
            table.add_column(column, justify="right")
        for e in self.epochs:
            table.add_row(str(e.epoch), f"{e.makespan_s:.2f}", str(e.samples), str(e.output_tokens),
                          f"{e.tokens_per_s:.1f}", str(e.longest_tokens), str(e.critical_steps), str(e.draft_tokens),
                          str(e.accepted_tokens), str(e.errors), ",".join(map(str, e.policy_versions)))
        console.print(table)
        if self.history_file:
            console.print(f"{self.records} rollouts written to {self.history_file}")


def run_rollouts(client: RolloutClient, problems: list[Problem], samples: int, epochs: int, sampling: SamplingSpec,
                 history_file: Path | None, console: Console | None = None, seed: int | None = None,
                 outputs: list[dict[int, list[int]]] | None = None, coupled: bool = False) -> RolloutRun:
    """Runs `epochs` batches of every problem x `samples`; see the module docstring. `seed`: epoch e's batch
    seed is derive(seed, e - 1), so a run with the same seed draws the same samples; None: the server's choice.
    `coupled` (needs `seed`): every epoch's batch seed is `seed`, so sample i of a problem carries the same key at
    every epoch (coupled epochs: under one policy it repeats its previous epoch's sample, which the drafter's
    same-key source drafts; after a weight update, up to the first draw the update flips). `outputs` (needs
    `seed`): gets, per epoch, every finished sample's output tokens by its keyed-sampling key (what the oracle
    benchmark arm drafts, drafter/oracle.py)."""
    if outputs is not None and seed is None:
        raise ValueError("outputs are kept by sample key, which needs a seed")
    if coupled and seed is None:
        raise ValueError("coupled epochs repeat each sample's key, which needs a seed")
    requests = [p.group(samples, sampling) for p in problems]
    groups = [g.model_dump(exclude_none=True) for g in requests]
    expected = len(problems) * samples
    figures: list[EpochFigures] = []
    records: list[RolloutRecord] = []
    with Progress(TextColumn("epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console or Console(stderr=True), transient=False) as bar:
        for epoch in range(1, epochs + 1):
            task = bar.add_task("samples", total=expected, epoch=epoch)
            start = time.perf_counter()
            received = tokens = drafted = accepted = errors = longest = critical = 0
            versions: set[int] = set()
            batch_seed = None if seed is None else seed if coupled else derive(seed, epoch - 1)
            keyed = seeded_groups(requests, batch_seed) if outputs is not None and batch_seed is not None else None
            if outputs is not None:
                outputs.append({})
            for sample in client.generate(groups, return_prompt_token_ids=history_file is not None,
                                          seed=batch_seed):
                bar.advance(task)
                tokens += len(sample.output_token_ids)
                longest = max(longest, len(sample.output_token_ids))
                critical = max(critical, len(sample.output_token_ids) - sample.accepted_tokens)
                drafted += sample.draft_tokens
                accepted += sample.accepted_tokens
                errors += sample.finish_reason == "error"
                versions.add(sample.policy_version)
                received += 1
                if keyed is not None and outputs is not None and sample.finish_reason in ("stop", "length"):
                    key = keyed[sample.group_index].sample_key(sample.sample_index)
                    if key is not None:
                        outputs[-1][key] = list(sample.output_token_ids)
                if history_file is not None and sample.finish_reason in ("stop", "length") \
                        and sample.prompt_token_ids:
                    records.append(RolloutRecord(sample.problem_id, sample.policy_version, sample.sample_index,
                                                 tuple(sample.prompt_token_ids or ()),
                                                 tuple(sample.output_token_ids), sample.finish_reason))
            figures.append(EpochFigures(epoch, time.perf_counter() - start, received, tokens, drafted, accepted,
                                        errors, sorted(versions), longest, critical))
    written = write_rollouts(history_file, records) if history_file is not None else 0
    return RolloutRun(figures, str(history_file) if history_file is not None else None, written)
