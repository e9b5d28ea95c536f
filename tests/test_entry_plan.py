"""The epoch entry's plan (pure): who donates, who receives, by log or by state, the join
step and its divisor; and the digest verdict when some members copied their state."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ftsystem.training.entry_plan import (NO_LOG, MemberRow, forked, join_step_absentees,
                                          plan_entry, source_indices, sync_by_log)
from ftsystem.training.fingerprint import echoes, judge

CHAINS = [bytes([i]) * 16 for i in range(3)]

rows_strategy = st.lists(st.builds(
    MemberRow, step=st.integers(0, 6), chain=st.sampled_from(CHAINS), fresh=st.booleans(),
    copied_from=st.sampled_from([0, 0, 101, 102, 103]),
    oldest_logged=st.sampled_from([NO_LOG, 0, 1, 2, 3, 4, 5]),
    signature=st.sampled_from([7, 7, 7, 9]), will_sum=st.booleans(),
    offers_join_step=st.booleans(), carry_size=st.integers(0, 100)), min_size=1, max_size=6
).map(lambda rows: [replace(r, me=101 + i) for i, r in enumerate(rows)])


@settings(max_examples=500, deadline=None)
@given(rows_strategy)
def test_the_plan_keeps_the_invariant_that_equal_step_and_chain_mean_equal_state(rows):
    plan = plan_entry(rows)
    donor = rows[plan.donor]
    holders = [r for r in rows if not r.fresh]
    # The donor holds the job's state whenever anybody does, and nobody holding it is ahead.
    if holders:
        assert not donor.fresh
    assert donor.step == max(r.step for r in holders or rows)
    # Exactly the members that may differ from the donor receive; nobody else's state moves.
    for i, row in enumerate(rows):
        same = not row.fresh and row.step == donor.step and row.chain == donor.chain
        assert (i in plan.receivers) == (i != plan.donor and not same), (i, row, plan)
    # By log only when every receiver is behind on steps the donor's log holds.
    if plan.log_possible:
        assert plan.receivers
        for r in plan.receivers:
            assert not rows[r].fresh and rows[r].step < donor.step
            assert 0 <= donor.oldest_logged <= rows[r].step + 1
    assert plan.log_last == donor.step
    assert plan.mismatched == tuple(i for i, r in enumerate(rows)
                                    if r.signature != donor.signature)


@settings(max_examples=500, deadline=None)
@given(rows_strategy)
def test_a_join_step_divides_by_the_members_that_sent_gradients(rows):
    plan = plan_entry(rows)
    assert plan.divisor == len(rows) - len(plan.join_step)
    if plan.join_step:
        offering = {i for i, r in enumerate(rows) if r.offers_join_step}
        assert set(plan.join_step) == offering
        # Everybody else sums real gradients, and one of them (holding the step's states)
        # gives the joiners the loop's states of that step.
        assert all(rows[i].will_sum for i in range(len(rows)) if i not in offering)
        assert plan.carry_source not in offering and plan.carry_source not in plan.receivers
        assert plan.divisor >= 1
    else:
        assert plan.carry_source == -1


@settings(max_examples=300, deadline=None)
@given(rows_strategy)
def test_the_donor_holds_the_chain_most_members_at_its_step_hold_echoes_not_counted(rows):
    plan = plan_entry(rows)
    donor = rows[plan.donor]
    holders = [r for r in rows if not r.fresh] or rows
    at_top = [r for r in holders if r.step == donor.step]
    sources = source_indices([r.me for r in rows], [r.copied_from for r in rows])
    echo = {id(r) for r, s in zip(rows, sources)
            if s is not None and rows[s].step == r.step and rows[s].chain == r.chain}
    voters = [r for r in at_top if id(r) not in echo] or at_top
    votes = Counter(r.chain for r in voters)
    assert votes[donor.chain] == max(votes.values())


def test_between_two_forks_at_one_step_the_majority_wins_not_the_lowest_index():
    a, b = CHAINS[1], CHAINS[2]
    rows = [MemberRow(step=5, chain=a), MemberRow(step=5, chain=b), MemberRow(step=5, chain=b)]
    plan = plan_entry(rows)
    assert rows[plan.donor].chain == b and plan.receivers == (0,)
    # A copy that still holds its source's chain is no vote: r1 loaded r0's state since the
    # last comparison, so a, a, b is one vote for each: the lowest index.
    rows = [MemberRow(step=5, chain=b, me=1), MemberRow(step=5, chain=a, me=2),
            MemberRow(step=5, chain=a, me=3, copied_from=2)]
    assert plan_entry(rows).donor == 0


def test_a_joiner_whose_join_step_failed_on_it_alone_still_sends_zeros_in_the_next_epoch():
    # The members committed step 8 in the epoch where the joiner's join-step all-reduce
    # failed; in the next epoch they sum step 9 while the joiner, at 7, still offers.
    rows = [MemberRow(step=8, chain=CHAINS[1], will_sum=True, oldest_logged=4),
            MemberRow(step=8, chain=CHAINS[1], will_sum=True, oldest_logged=4),
            MemberRow(step=7, chain=CHAINS[0], offers_join_step=True, copied_from=5)]
    plan = plan_entry(rows)
    assert plan.receivers == (2,) and plan.join_step == (2,) and plan.divisor == 2
    assert sync_by_log(plan, rows, {8: CHAINS[0]})
    assert not forked(plan, rows, {8: CHAINS[0]}, 2)
    assert forked(plan, rows, {8: CHAINS[2]}, 2)


def test_at_the_jobs_start_everybody_takes_member_zeros_state():
    plan = plan_entry([MemberRow(step=0, chain=CHAINS[0], fresh=True)] * 3)
    assert plan.donor == 0 and plan.receivers == (1, 2) and not plan.log_possible


def test_a_member_behind_by_an_uncommitted_step_and_a_fresh_joiner():
    rows = [MemberRow(step=10, chain=CHAINS[0], oldest_logged=6),
            MemberRow(step=11, chain=CHAINS[1], oldest_logged=6),
            MemberRow(step=0, chain=CHAINS[2], fresh=True)]
    plan = plan_entry(rows)
    assert plan.donor == 1 and plan.receivers == (0, 2)
    assert not plan.log_possible  # a fresh receiver needs the whole state


def test_rows_travel_as_words_and_back():
    row = MemberRow(step=12, chain=CHAINS[2], fresh=True, me=-9, copied_from=4, oldest_logged=3,
                    signature=-5, will_sum=True, offers_join_step=True, carry_size=77)
    assert MemberRow.from_words(row.words()) == row


def test_join_step_absentees_need_every_other_member_summing():
    assert join_step_absentees([True, True, False], [False, False, True], []) == ([2], 0)
    assert join_step_absentees([True, False, False], [False, False, True], []) == ([], -1)
    assert join_step_absentees([True, True, False], [False, False, True], [0]) == ([2], 1)
    assert join_step_absentees([True, False], [False, True], [0]) == ([], -1)


def test_a_copy_of_a_bad_donor_cannot_outvote_the_healthy_replicas():
    bad, good = b"b" * 16, b"g" * 16
    # donor 0 gone bad before the copy, two healthy members, and joiner 3 that copied it
    verdict = judge([bad, good, good, bad], sources=[None, None, None, 0])
    assert verdict.majority == (1, 2) and verdict.divergent == (0, 3)
    # counted like the others, the copy would have made a 2-2 split
    assert not judge([bad, good, good, bad]).repairable
    # one healthy against the donor: nobody can tell, and the healthy one is not overwritten
    assert not judge([bad, good, bad], sources=[None, None, 0]).repairable


def test_copies_made_before_their_source_went_bad_still_vote():
    bad, good = b"b" * 16, b"g" * 16
    # members 1 and 2 loaded member 0's state (the job's start, a cold restart), then 0 went
    # bad: they no longer echo it, so they outvote it
    verdict = judge([bad, good, good], sources=[None, 0, 0])
    assert verdict.majority == (1, 2) and verdict.divergent == (0,)
    assert echoes([bad, good, bad], [None, 0, 0]) == [False, False, True]
