"""The fleet's protocol for a job split into shards, proven by exploring orders (issue 39,
point 2), not only by examples.

A hypothesis state machine plays one job of a few shards, its results JSON Lines or
Parquet files (which the merge joins into files of its own), on as many daemons as it
likes, over one store with S3's conditional writes (`If-None-Match: *`, `If-Match`) and
its strongly consistent listing, whose ETags are not MD5s (as under SSE-KMS: the same
bytes written twice are two versions), and one queue with SQS's leases and delays. Each
delivery of a message runs on a daemon of its own, on a thread that stops before every
call it makes to S3 or SQS until the machine lets it make it. So the machine picks which
daemon goes on at each call, which message is delivered (again, to a second daemon,
while the first still holds it: at-least-once), when a daemon dies (before a call, or
after it with the answer lost; its message comes back once its lease runs out), and when
time passes (watches come due, merge claims run out). What runs is the daemon's own
code: `Intake` admits each message (plans the job, checks a shard against its plan,
carries out a watch), a shard's items get the results a model gives them, with a
checkpoint half-way and the check a running shard makes for another run's commit, and
`Finisher` commits it (`Shards.commit`, which merges: `Merger`).

After every step it checks what the design promises (docs/DESIGN.md, "The protocol,
proven"): at most one job.json per request; job.json, once written, names results equal
to an unsharded run's (the rows of the Parquet files it names, in order), each there;
no rejected.json (the job is valid); nothing a written or running merge needs is
removed; from any state, every daemon then holding a message dead, the messages left
run the job to its end (none dead-lettered); and once it has, nothing is left of its
shards, nor a results file job.json does not name.

`make test` plays 60 short games of a JSON Lines job, the same ones each time; `make
prove` (PROTOCOL_PROOF=long) plays many more, longer, at random, half of them of a
Parquet job.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.support import fleet
from tests.support.fleet import (
    CLOCK,
    LEASE_S,
    OUTPUT,
    START_S,
    Daemon,
    World,
    inputs,
    job_body,
    one_after_another,
    unsharded,
    world_at,
)
from tests.support.gated import Actor, Fate
from worker.datasets.tables import JSON_LINES, PARQUET
from worker.jobs.plan import COMMIT_SUFFIX, Commit
from worker.loops import results
from worker.loops.notices import REJECTED
from worker.ports import S3Location
from worker.retry import Backoff
from worker.sharding import claims, merging, planning, shards, stragglers

LONG = os.environ.get("PROTOCOL_PROOF") == "long"
MOST_DAEMONS = 3  # holding a message at once
# The job's results format, drawn by the game: as often Parquet as JSON Lines in `make
# prove`; JSON Lines alone in `make test`, whose time a Parquet game takes four times over
# (each run to the end writes its shards' files and joins them; a few of them, or a draw
# that changes which JSON Lines games are played, took 4-5 s more), the Parquet merge's
# orders there played by the example tests below.
FORMATS = [JSON_LINES, PARQUET] if LONG else [JSON_LINES]
# Where the daemons keep their files: in memory where the machine has it (a join makes
# and removes a directory, and writes and reads files, on every run to the end).
SPOOL = "/dev/shm" if os.path.isdir("/dev/shm") else None
# What is left under the output of a job run to its end besides the outputs its job.json
# names: plan.json, job.json, the mark that its notices went, and progress.json, the
# job's last word.
FINAL = {"plan.json", "job.json", "announced", "progress.json"}
# job.json's fields that differ between two runs of a job, or say how it was run.
RUN_FIELDS = {
    "received_at",
    "finished_at",
    "duration_s",
    "worker",
    "outputs",
    "device_s",
    "attempt",
    "resumed",
    "shards",
}


class FleetProtocol(RuleBasedStateMachine):
    """Daemons taking one sharded job's messages in any order, dying anywhere."""

    def __init__(self) -> None:
        super().__init__()
        CLOCK.now = START_S
        self._directory = Path(tempfile.mkdtemp(prefix="protocol-", dir=SPOOL))
        self.world = world_at(self._directory)
        self.actors: dict[str, Actor] = {}
        self._names = itertools.count(1)
        self._committed: dict[str, bytes] = {}  # commit markers seen, by name
        self._checked_at: tuple[Any, ...] = ()
        self._ended: World | None = None
        self.items = 0
        self.results_format = JSON_LINES

    @initialize(
        items=st.integers(2, 6),
        shard_items=st.integers(1, 3),
        results_format=st.sampled_from(FORMATS),
    )
    def send_the_job(self, items: int, shard_items: int, results_format: str) -> None:
        """A job of `items` inputs in shards of `shard_items` (two shards at least), its
        results in `results_format`."""
        self.items, self.results_format = items, results_format
        shard_items = min(shard_items, items - 1)
        self.world.queue.send(job_body(inputs(items), shard_items, results_format))

    def teardown(self) -> None:
        for actor in self.actors.values():
            while not actor.ended:
                actor.step("dies")
        self.world.arrays.close()
        shutil.rmtree(self._directory, ignore_errors=True)

    # What the daemons and the queue do ------------------------------------------

    def _live(self) -> list[str]:
        return sorted(name for name, actor in self.actors.items() if not actor.ended)

    def _deliverable(self) -> bool:
        return bool(self.world.queue.visible()) and len(self._live()) < MOST_DAEMONS

    def _held(self) -> list[str]:
        live = {self.actors[name].message_id for name in self._live()}
        return sorted(message for message in live if message in self.world.queue.messages)

    def start(self, message_id: str) -> Actor:
        """A daemon of its own receives the message, and goes up to its first call."""
        name = f"d{next(self._names)}"
        message = self.world.queue.deliver(message_id, name)
        actor = self.actors[name] = Actor(name, message_id)
        daemon = Daemon(self.world, actor, name)  # its parts make no call as they are made
        actor.start(functools.partial(daemon.take, message))
        self._after(actor)
        return actor

    def kill(self, actor: Actor, fate: Fate = "dies") -> None:
        actor.step(fate)
        self._after(actor)

    def finish(self, actor: Actor) -> None:
        """Let the daemon make every call left to it."""
        while not actor.ended:
            actor.step()
        self._after(actor)

    def check(self) -> None:
        """Every promise, as after a step."""
        self.at_most_one_job_json_per_request()
        self.job_json_names_the_unsharded_runs_results()
        self.a_valid_job_is_never_rejected()
        self.a_merge_keeps_what_it_needs()
        self.every_run_that_can_still_finish_does()
        self.nothing_is_left_once_the_job_is_done()

    @precondition(lambda self: self._deliverable())
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A daemon receives a visible message."""
        self.start(data.draw(st.sampled_from(sorted(self.world.queue.visible())), "message"))

    @precondition(lambda self: self._held() and len(self._live()) < MOST_DAEMONS)
    @rule(data=st.data())
    def deliver_again(self, data: st.DataObject) -> None:
        """A message held by a live daemon is delivered to another too (SQS delivers at
        least once; a lease lost unnoticed)."""
        self.start(data.draw(st.sampled_from(self._held()), "message"))

    @precondition(lambda self: self._live())
    @rule(data=st.data(), calls=st.integers(1, 40))
    def go_on(self, data: st.DataObject, calls: int) -> None:
        """A daemon makes its next calls to S3 and SQS (its whole run, at most)."""
        self._go_on(self._daemon(data), calls, "lives")

    @precondition(lambda self: self._live())
    @rule(data=st.data(), calls=st.integers(0, 30), answered=st.booleans())
    def die(self, data: st.DataObject, calls: int, answered: bool) -> None:
        """A daemon makes its next `calls` calls, then dies before the next one, or
        after it with the answer lost."""
        self._go_on(self._daemon(data), calls, "dies_unanswered" if answered else "dies")

    @precondition(lambda self: self._live())
    @rule(data=st.data(), calls=st.integers(0, 30), retried=st.booleans())
    def call_fails(self, data: st.DataObject, calls: int, retried: bool) -> None:
        """A daemon makes its next `calls` calls, then the next one fails: S3 or SQS
        refuse it (throttled), or do it and the answer is lost, and the adapter's
        retry answers."""
        self._go_on(self._daemon(data), calls, "retried" if retried else "fails")

    def _go_on(self, actor: Actor, calls: int, then: Fate) -> None:
        """`calls` calls made, then the next one's fate is `then`."""
        for number in range(calls + 1):
            if actor.ended:
                break
            actor.step(then if number == calls else "lives")
        self._after(actor)

    def _daemon(self, data: st.DataObject) -> Actor:
        return self.actors[data.draw(st.sampled_from(self._live()), "daemon")]

    @rule(seconds=st.sampled_from([5, LEASE_S, claims.MERGE_CLAIM_S + 1, 3600]))
    def time_passes(self, seconds: float) -> None:
        CLOCK.now += seconds

    def _after(self, actor: Actor) -> None:
        if actor.ended:
            self.world.queue.let_go(actor.name)

    # What the design promises -----------------------------------------------------

    @invariant()
    def at_most_one_job_json_per_request(self) -> None:
        assert self.world.store.job_json_writes <= 1

    @invariant()
    def job_json_names_the_unsharded_runs_results(self) -> None:
        _check_done(self.world, self.items, self.results_format)

    @invariant()
    def a_valid_job_is_never_rejected(self) -> None:
        """The game's job is valid, its shards' results join: no delivery refuses it as
        a whole (a merge's `PoisonMerge`), now or on the way to its end."""
        assert OUTPUT + REJECTED not in self.world.store.objects
        assert OUTPUT + REJECTED not in self._run_to_end().store.objects

    @invariant()
    def a_merge_keeps_what_it_needs(self) -> None:
        """Until job.json is written, a shard's commit marker, once written, stays as it
        is, and so do the files it names."""
        if OUTPUT + "job.json" in self.world.store.objects:
            return
        objects = self.world.store.objects
        for uri, data in objects.items():
            if uri.endswith(COMMIT_SUFFIX):
                self._committed.setdefault(uri, data)
        for uri, data in self._committed.items():
            assert objects.get(uri) == data, f"{uri} removed or changed before job.json"
            commit = Commit.model_validate_json(data)
            directory = uri.rsplit("/", 2)[0] + "/"  # the files beside the markers' folder
            for file in [*commit.results, commit.log]:
                assert directory + file.name in objects, f"{file.name} removed before job.json"

    @invariant()
    def every_run_that_can_still_finish_does(self) -> None:
        """Every daemon holding a message now dead, the messages left, run one after
        another, end the job: job.json written, what it names as an unsharded run's,
        nothing dead-lettered."""
        ended = self._run_to_end()
        assert not ended.queue.dead_letters, ended.queue.dead_letters
        assert OUTPUT + "job.json" in ended.store.objects, sorted(ended.names())
        _check_done(ended, self.items, self.results_format)
        assert ended.store.job_json_writes <= 1

    @invariant()
    def nothing_is_left_once_the_job_is_done(self) -> None:
        """Once job.json is written and no message of the job is left, nothing of its
        shards (or checkpoints) is left either, nor a results file job.json does not
        name; so after running it to its end. (A merger fenced as it sends a Parquet
        file may leave one, a late write, where its join made more files than the
        merger that took over: not here, where every daemon cuts them alike.)"""
        if OUTPUT + "job.json" in self.world.store.objects and not self.world.queue.messages:
            _check_only_final_left(self.world)
        _check_only_final_left(self._run_to_end())

    def _run_to_end(self) -> World:
        """The world as it ends if every daemon now holding a message dies now and the
        messages left run one after another (worked out once per state)."""
        queue = self.world.queue.messages.values()
        state = (self.world.store.changes, CLOCK.now, *((m.handle, m.visible_at) for m in queue))
        if self._ended is None or state != self._checked_at:
            now = CLOCK.now
            ended = self.world.copy()
            for name in self._live():
                ended.queue.let_go(name)
            try:
                ended.run_to_end()
            finally:
                CLOCK.now = now
            self._ended, self._checked_at = ended, state
        return self._ended


def _check_done(world: World, items: int, results_format: str) -> None:
    """If job.json is written: it is the only one, it completes the job (the outputs it
    names are those there), and its results and fields are an unsharded run's."""
    objects = world.store.objects
    if OUTPUT + "job.json" not in objects:
        return
    summary = json.loads(objects[OUTPUT + "job.json"])
    for name, etag in summary["outputs"].items():
        listed = world.store.objects_under(S3Location.parse(OUTPUT + name)).get("")
        assert listed == etag, f"job.json names {name}, no longer there"
    rows, whole = unsharded(items, results_format)
    assert fleet.results(world, summary) == rows
    fields = {key: value for key, value in summary.items() if key not in RUN_FIELDS}
    assert fields == {key: value for key, value in whole.items() if key not in RUN_FIELDS}


def _check_only_final_left(world: World) -> None:
    """job.json is written, and only plan.json, it, the outputs it names and the job's
    last words are under the output."""
    assert OUTPUT + "job.json" in world.store.objects, sorted(world.names())
    summary = json.loads(world.store.objects[OUTPUT + "job.json"])
    left = world.names() - FINAL - set(summary["outputs"])
    assert not left, sorted(left)


@pytest.fixture
def protocol(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The protocol's modules on the model's clock, their calls one after another, a
    finish tried again at once; the daemons' logs kept out of the test's output."""
    for module in (shards, claims, stragglers):
        monkeypatch.setattr(module, "time", CLOCK)
    for module in (shards, merging, stragglers, planning):
        monkeypatch.setattr(module, "each_at_once", one_after_another)
    monkeypatch.setattr(results, "FINISH_BACKOFF", Backoff(base_s=0.0, cap_s=0.0))
    with structlog.testing.capture_logs():
        yield


# `make test` plays the same short games every time, and reports a failing one as found
# (shrinking it can take longer than a test may); `make prove` plays many more, at random,
# and shrinks what fails.
PROFILE = (
    settings(
        max_examples=int(os.environ.get("PROTOCOL_EXAMPLES", "2000")),
        stateful_step_count=60,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    if LONG
    else settings(
        max_examples=60,
        stateful_step_count=30,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
)


def test_the_protocol_keeps_its_promises_in_every_order(protocol: None) -> None:
    """Every game the machine plays keeps the five promises after each step."""
    run_state_machine_as_test(FleetProtocol, settings=PROFILE)


def _go_on_until(actor: Actor, call: str) -> None:
    """Let the daemon make its calls up to the first that `call` (a pattern) matches."""
    while not re.fullmatch(call, actor.pending):
        assert not actor.ended, f"{actor.name} ended before {call}"
        actor.step()


def _shard_0_committed_with_no_watch(game: FleetProtocol, results_format: str) -> None:
    """The job of two inputs planned (m2 and m3 run shards 0 and 1), and shard 0
    committed with no watch armed (S3 refused the marker): shard 1's run is the last
    delivery of the job to come."""
    game.send_the_job(items=2, shard_items=1, results_format=results_format)
    game.finish(game.start("m1"))
    first = game.start("m2")
    _go_on_until(first, r"put shards/\w+/watch")
    first.step("fails")
    game.finish(first)


def test_a_merge_claim_left_by_a_merger_whose_message_is_gone_is_watched_until_it_runs_out(
    protocol: None,
) -> None:
    """A game the machine found. Shard 0's message is delivered twice; the later
    delivery commits the shard and deletes the message. The last shard's run commits
    and dies before its merge; the earlier delivery of shard 0 finds every shard
    committed, takes the merge claim, and dies: nothing brings its message back. The
    watch that comes finds the claim standing, and has a watch due once it runs out,
    in place of itself: the marker named it, so it counted as the one due, no watch
    followed (nor did the last shard's redelivery arm one, the marker saying a watch
    was due), and the job waited without job.json for ever."""
    game = FleetProtocol()
    try:
        game.send_the_job(items=2, shard_items=1, results_format=JSON_LINES)
        game.finish(game.start("m1"))  # planned: m2 and m3 run shards 0 and 1
        # Shard 0's message delivered twice: the later delivery commits the shard, arms
        # a watch (m4) and deletes the message, with the latest receipt handle.
        first, second = game.start("m2"), game.start("m2")
        game.finish(second)
        last = game.start("m3")
        _go_on_until(last, r"put shards/\w+/commits/000001\.commit")
        last.step()
        _go_on_until(last, r"list shards/\w+/commits/\d+")  # its merge begins
        game.kill(last)
        _go_on_until(first, "compose .*")  # it holds the claim
        game.kill(first)
        CLOCK.now += shards.WATCH_MIN_S
        game.finish(game.start("m4"))
        game.check()
    finally:
        game.teardown()


def test_a_run_that_finds_its_shard_committed_by_its_own_messages_other_delivery_merges(
    protocol: None,
) -> None:
    """A game the machine found. Shard 1 commits, its watch not armed (S3 refuses the
    marker). Shard 0's message is delivered twice: the earlier delivery commits the
    shard, takes the merge claim and dies; the later one, running, sees the marker.
    It stopped and deleted the message, the only thing that could bring the dead
    merge back, and the job waited without job.json for ever. It goes on now, and
    its commit, finding the other's marker, merges the job (its claim is the same
    message's) before the message goes."""
    game = FleetProtocol()
    try:
        # A check half-way through a run.
        game.send_the_job(items=4, shard_items=2, results_format=JSON_LINES)
        game.finish(game.start("m1"))  # planned: m2 and m3 run shards 0 and 1
        last = game.start("m3")
        _go_on_until(last, r"put shards/\w+/watch")
        last.step("fails")
        game.finish(last)
        earlier, later = game.start("m2"), game.start("m2")
        _go_on_until(later, r"list shards/\w+/000000\.inputs")  # a running shard's check
        _go_on_until(earlier, "compose .*")  # committed, and it holds the claim
        game.kill(earlier)
        game.finish(later)
        assert OUTPUT + "job.json" in game.world.store.objects
        game.check()
    finally:
        game.teardown()


@pytest.mark.parametrize("late", ["dies", "goes_on"])
def test_a_late_planners_inputs_files_are_removed_once_the_job_is_merged(
    protocol: None, late: str
) -> None:
    """A game the machine found. The job's message is delivered twice: the later
    delivery finds plan.json written and no shard marked sent, and stops before writing
    shard 0's inputs file; the earlier one sends the shards, which commit and merge.
    The later delivery then writes the file, under the shards' directory the merge
    removed, and dies: its message came back, found the job done, and the file stayed
    for ever. The delivery that finds the job done removes it now; and one that goes
    on sees the job merged once its files are written, removes them and sends no
    shard."""
    game = FleetProtocol()
    try:
        game.send_the_job(items=2, shard_items=1, results_format=JSON_LINES)
        earlier, later = game.start("m1"), game.start("m1")
        _go_on_until(earlier, r"send shard 0,shard 1 in 0 s")
        _go_on_until(later, r"put shards/\w+/000000\.inputs")
        game.finish(earlier)
        game.finish(game.start("m2"))
        game.finish(game.start("m3"))
        assert OUTPUT + "job.json" in game.world.store.objects
        later.step()
        if late == "dies":
            game.kill(later)
        else:
            game.finish(later)
            bodies = [json.loads(m.body) for m in game.world.queue.messages.values()]
            assert not [body for body in bodies if "shard" in body], "a merged job's shards sent"
        game.check()
    finally:
        game.teardown()


@pytest.mark.parametrize("planner", ["dies", "goes_on"])
def test_a_planners_marks_of_shards_sent_after_their_merge_are_removed(
    protocol: None, planner: str
) -> None:
    """A game the machine found. The job's message sends its shards, which commit and
    merge (and their watch ends) before it marks them sent: the marks went under the
    shards' directory that the merge had removed, and stayed for ever. The planner that
    goes on sees the job merged once its marks are written, and removes them; one that
    dies first leaves them to its message's next delivery, which finds the job done."""
    game = FleetProtocol()
    try:
        game.send_the_job(items=2, shard_items=1, results_format=JSON_LINES)
        first = game.start("m1")
        _go_on_until(first, r"send shard 0,shard 1 in 0 s")
        first.step()
        game.finish(game.start("m2"))
        game.finish(game.start("m3"))
        assert OUTPUT + "job.json" in game.world.store.objects
        CLOCK.now += shards.WATCH_MIN_S
        game.finish(game.start("m4"))  # the watch, which finds the job merged
        _go_on_until(first, r"put shards/\w+/000001\.sent")
        first.step()
        if planner == "dies":
            game.kill(first)
            CLOCK.now += LEASE_S
            game.finish(game.start("m1"))
        else:
            game.finish(first)
        game.check()
    finally:
        game.teardown()


@pytest.mark.parametrize(
    "write",
    [r"put shards/\w+/merge", r"compose job\.log", r"put job\.json"],
    ids=["claim", "compose", "job.json"],
)
def test_a_merge_write_retried_after_its_answer_was_lost_is_its_own(
    protocol: None, write: str
) -> None:
    """A game the machine found. The last shard's merge renews its claim (or writes
    job.json), and the answer is lost: the adapter's retry fails its condition against
    the first try's write, whose ETag, not an MD5 of the bytes, tells it nothing. The
    merge took itself for fenced off by another and left everything, its message
    deleted and no watch to come (shard 0's was not armed): the job never ended (or its
    shards' files stayed for ever). The merge now finds its own bytes there and goes
    on."""
    game = FleetProtocol()
    try:
        _shard_0_committed_with_no_watch(game, JSON_LINES)
        last = game.start("m3")
        _go_on_until(last, r"compose results\.jsonl")  # it holds the claim
        last.step()
        _go_on_until(last, write)
        last.step("retried")
        game.finish(last)
        assert OUTPUT + "job.json" in game.world.store.objects
        game.check()
    finally:
        game.teardown()


def test_a_merger_that_finds_the_claim_gone_after_the_merge_leaves_none(protocol: None) -> None:
    """A game the machine found. A watch sees every shard committed and, before it
    looks at the merge claim, the last shard's run merges the job and removes the
    shards' files, the claim with them; another delivery of the watch finds the job
    done and deletes the message. The first delivery then found no claim, wrote one
    anew, and died before it saw the job done: the claim was left for ever, nothing of
    the job to come. No claim now means the job was merged (the planner opens it), and
    none is written where it is gone."""
    game = FleetProtocol()
    try:
        game.send_the_job(items=2, shard_items=1, results_format=JSON_LINES)
        game.finish(game.start("m1"))  # planned: m2 and m3 run shards 0 and 1
        game.finish(game.start("m2"))  # shard 0 commits and arms a watch (m4)
        last = game.start("m3")
        _go_on_until(last, r"put shards/\w+/commits/000001\.commit")
        last.step()  # shard 1 commits
        CLOCK.now += shards.WATCH_MIN_S
        late = game.start("m4")
        _go_on_until(late, r"list shards/\w+/merge")  # it found every shard committed
        game.finish(last)
        assert OUTPUT + "job.json" in game.world.store.objects
        game.finish(game.start("m4"))  # finds the job done, and deletes the watch
        _go_on_until(late, r"(put|get) .*")  # a claim written anew, or job.json read
        game.kill(late, "dies_unanswered")  # made, then it dies
        assert not game.world.queue.messages
        game.check()
    finally:
        game.teardown()


def _last_shard_merging(game: FleetProtocol, results_format: str, call: str) -> Actor:
    """The job of four inputs planned (m2 and m3 run shards 0 and 1), shard 0
    committed, and shard 1's run merging, up to its first call `call` matches."""
    game.send_the_job(items=4, shard_items=2, results_format=results_format)
    game.finish(game.start("m1"))
    game.finish(game.start("m2"))
    last = game.start("m3")
    _go_on_until(last, call)
    return last


def test_a_merger_dead_between_two_joined_files_leaves_the_next_to_keep_one_and_write_one(
    protocol: None,
) -> None:
    """A Parquet job's merge joins its shards' files into several of its own, each sent
    on condition that it is as listed: a merger that dies after the first leaves it, and
    its message's redelivery, resuming the claim, lists it, finds it holds what it would
    write and keeps it (the same version), writes the rest, and job.json names them,
    the rows an unsharded run's."""
    game = FleetProtocol()
    try:
        last = _last_shard_merging(game, PARQUET, r"put results/part-000000-0001\.parquet")
        results = game.world.store.objects_under(S3Location.parse(OUTPUT + "results/"))
        first = results["part-000000-0000.parquet"]
        game.kill(last)
        CLOCK.now += LEASE_S
        game.finish(game.start("m3"))
        summary = json.loads(game.world.store.objects[OUTPUT + "job.json"])
        assert [name for name in summary["outputs"] if name.startswith("results/")] == [
            "results/part-000000-0000.parquet",
            "results/part-000000-0001.parquet",
        ]
        assert summary["outputs"]["results/part-000000-0000.parquet"] == first
        game.check()
    finally:
        game.teardown()


@pytest.mark.parametrize("results_format", [JSON_LINES, PARQUET])
def test_a_merge_whose_removal_of_the_shards_files_fails_leaves_none_behind(
    protocol: None, results_format: str
) -> None:
    """A game the machine found, playing a Parquet job; JSON Lines' is the same. Shard 0
    commits, its watch not armed (S3 refuses the marker). Shard 1's run commits, merges
    and writes job.json; its listing of the shards' files to remove them fails
    (throttled past the adapter's tries). Its message was deleted, and with no watch to
    come the shards' files, their commit markers and the merge claim stayed for ever.
    The message comes back now (`Written.shards_left`), and its next delivery removes them."""
    game = FleetProtocol()
    try:
        _shard_0_committed_with_no_watch(game, results_format)
        last = game.start("m3")
        _go_on_until(last, r"put job\.json")
        _go_on_until(last, r"list shards/\w+/")  # the listing of what to remove
        last.step("fails")
        game.finish(last)
        assert OUTPUT + "job.json" in game.world.store.objects
        assert list(game.world.queue.messages) == ["m3"]  # back to remove them
        game.check()
    finally:
        game.teardown()


def test_a_redelivery_that_merges_a_committed_job_and_cannot_remove_its_files_comes_back(
    protocol: None,
) -> None:
    """The last shard's run commits and dies before its merge; its message's next
    delivery finds the shard committed, merges the job, and its listing of the shards'
    files fails: its message comes back (`Written.shards_left`), announced, to remove them."""
    game = FleetProtocol()
    try:
        _shard_0_committed_with_no_watch(game, JSON_LINES)
        last = game.start("m3")
        _go_on_until(last, r"put shards/\w+/commits/000001\.commit")
        last.step()
        game.kill(last)
        CLOCK.now += LEASE_S
        again = game.start("m3")
        _go_on_until(again, r"put job\.json")
        _go_on_until(again, r"list shards/\w+/")  # the listing of what to remove
        again.step("fails")
        game.finish(again)
        assert list(game.world.queue.messages) == ["m3"]  # back to remove them
        assert OUTPUT + "announced" in game.world.store.objects
        game.check()
    finally:
        game.teardown()


@pytest.mark.parametrize("results_format", [JSON_LINES, PARQUET])
def test_a_merger_fenced_by_its_own_messages_other_delivery_watches_the_claim(
    protocol: None, results_format: str
) -> None:
    """A game the machine found, playing a Parquet job; JSON Lines' is the same. Shard 0
    commits, its watch not armed (S3 refuses the marker). Shard 1's message is delivered
    twice: the later delivery commits the shard and merges; the earlier one finds the
    shard committed and takes the claim over (the same message's). The later, fenced off
    at its next renewal, deleted the message (its receipt handle the latest), the only
    thing that could bring the earlier one's merge back: that one died, and the job
    waited without job.json, its claim held, for ever. A merger fenced off now has a
    watch of the claim due, as one that finds another merging does."""
    game = FleetProtocol()
    try:
        _shard_0_committed_with_no_watch(game, results_format)
        earlier, later = game.start("m3"), game.start("m3")
        _go_on_until(later, r"get shards/\w+/commits/000000\.commit")  # it holds the claim
        _go_on_until(earlier, r"put shards/\w+/merge")
        earlier.step()  # the claim taken over
        game.finish(later)
        assert "m3" not in game.world.queue.messages
        game.kill(earlier)
        game.check()
    finally:
        game.teardown()


@pytest.mark.parametrize(
    ("results_format", "rollout"), [(JSON_LINES, False), (PARQUET, False), (PARQUET, True)]
)
def test_a_merger_stalled_past_its_claim_and_the_one_that_took_it_over_write_one_join(
    protocol: None, results_format: str, rollout: bool
) -> None:
    """An order `make prove` found, playing a Parquet job; JSON Lines' is the same. The
    last shard's run merges: it renews its claim, then stalls past it before it writes
    job.json. Its message's redelivery takes the claim over and lists the outputs, the
    first's join among them. The first then writes job.json, naming its files, and
    dies. The second wrote its join over them, the same bytes but, where ETags are not
    MD5s, another version: job.json named files no longer there, and the job's results
    were never readable. A merger that finds its file written with the bytes it would
    write keeps it as it is. In a `rollout` the second is set to cut its Parquet files
    otherwise (one file where the first cut one a row group): it cuts as the claim says
    the first did, so the bytes are the same all the same."""
    game = FleetProtocol()
    try:
        first = _last_shard_merging(game, results_format, r"put job\.json")
        CLOCK.now += claims.MERGE_CLAIM_S + LEASE_S  # it stalls, past its claim and lease
        if rollout:  # the next daemon's settings
            game.world.tables = game.world.tables.cut_at((2**30, game.world.tables.cut[1]))
        second = game.start("m3")
        _go_on_until(second, r"put job\.json")  # its join and job.log written, or kept
        first.step()  # job.json, naming the first's files
        game.kill(first)
        game.finish(second)
        game.check()
    finally:
        game.teardown()


def test_a_claim_takes_a_recorded_cut_only_within_bounds() -> None:
    """A claim lies under the job's output, anyone's to write: a cut it records is taken
    only where the merger could join at it without exhausting itself."""
    own = (256 * 2**20, 64 * 2**20)
    assert claims._recorded_cut([2**28, 2**16], own) == (2**28, 2**16)
    assert claims._recorded_cut([1, 2**28], own) == (1, 2**28)
    forged = [
        [1, 1],  # a row a group
        [2**40, 2**16],  # millions of groups a file, each in its footer
        [2**30, 2**30],  # row groups of a GiB held as they are joined
        [0, 2**20],
        [True, 2**20],
        [1.5, 2**20],
        "1,2",
        [1, 2, 3],
        None,
    ]
    for recorded in forged:
        assert claims._recorded_cut(recorded, own) == own
    assert claims._recorded_cut([1, 120], (1, 120)) == (1, 120)  # its own, however small
