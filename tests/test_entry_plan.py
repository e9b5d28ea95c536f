"""The epoch entry's plan (pure): who donates, who receives, by log or by state, the join
step and its divisor; and the digest verdict when some members copied their state."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from ftsystem.training.entry_plan import (NO_LOG, MemberRow, copy_inherits_lineage, forked,
                                          join_step_absentees, plan_entry, sync_by_log)
from ftsystem.training.fingerprint import describe_split, judge

CHAINS = [bytes([i]) * 16 for i in range(3)]

rows_strategy = st.lists(st.builds(
    MemberRow, step=st.integers(0, 6), chain=st.sampled_from(CHAINS), fresh=st.booleans(),
    lineage=st.sampled_from([101, 102, 103, 104, 105, 106]), verified=st.booleans(),
    oldest_logged=st.sampled_from([NO_LOG, 0, 1, 2, 3, 4, 5]),
    signature=st.sampled_from([7, 7, 7, 9]), will_sum=st.booleans(),
    offers_join_step=st.booleans(), carry_size=st.integers(0, 100)), min_size=1, max_size=6
)


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
def test_the_donor_holds_the_chain_with_most_lineages_at_its_step(rows):
    plan = plan_entry(rows)
    donor = rows[plan.donor]
    holders = [r for r in rows if not r.fresh] or rows
    at_top = [r for r in holders if r.step == donor.step]
    votes = Counter(chain for chain, _ in {(r.chain, r.lineage) for r in at_top})
    assert votes[donor.chain] == max(votes.values())


def test_between_two_forks_at_one_step_the_majority_wins_not_the_lowest_index():
    a, b = CHAINS[1], CHAINS[2]
    rows = [MemberRow(step=5, chain=a, lineage=1), MemberRow(step=5, chain=b, lineage=2),
            MemberRow(step=5, chain=b, lineage=3)]
    plan = plan_entry(rows)
    assert rows[plan.donor].chain == b and plan.receivers == (0,)
    # Members of one copy lineage are one vote: r2 loaded r1's state since the last
    # comparison, so b, a, a is one vote for each: the lowest index.
    rows = [MemberRow(step=5, chain=b, lineage=1), MemberRow(step=5, chain=a, lineage=2),
            MemberRow(step=5, chain=a, lineage=2)]
    assert plan_entry(rows).donor == 0


def test_a_joiner_whose_join_step_failed_on_it_alone_still_sends_zeros_in_the_next_epoch():
    # The members committed step 8 in the epoch where the joiner's join-step all-reduce
    # failed; in the next epoch they sum step 9 while the joiner, at 7, still offers.
    rows = [MemberRow(step=8, chain=CHAINS[1], will_sum=True, oldest_logged=4),
            MemberRow(step=8, chain=CHAINS[1], will_sum=True, oldest_logged=4),
            MemberRow(step=7, chain=CHAINS[0], offers_join_step=True, lineage=5)]
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
    row = MemberRow(step=12, chain=CHAINS[2], fresh=True, lineage=-9, verified=True,
                    oldest_logged=3, signature=-5, will_sum=True, offers_join_step=True,
                    carry_size=77)
    assert MemberRow.from_words(row.words()) == row


def test_join_step_absentees_need_every_other_member_summing():
    assert join_step_absentees([True, True, False], [False, False, True], []) == ([2], 0)
    assert join_step_absentees([True, False, False], [False, False, True], []) == ([], -1)
    assert join_step_absentees([True, True, False], [False, False, True], [0]) == ([2], 1)
    assert join_step_absentees([True, False], [False, True], [0]) == ([], -1)


def test_a_copy_of_a_bad_donor_cannot_outvote_the_healthy_replicas():
    bad, good = b"b" * 16, b"g" * 16
    # donor 0 gone bad before the copy, two healthy members, and joiner 3 that copied it
    verdict = judge([bad, good, good, bad], lineages=[10, 11, 12, 10])
    assert verdict.majority == (1, 2) and verdict.divergent == (0, 3)
    # counted like the others, the copy would have made a 2-2 split
    assert not judge([bad, good, good, bad]).repairable
    # one healthy against the donor: nobody can tell, and the healthy one is not overwritten
    assert not judge([bad, good, bad], lineages=[10, 11, 10]).repairable


def test_a_cycle_of_copies_is_one_witness_and_never_hands_a_corruption_the_job():
    # r1 and r2 hold r0's state; r0 restarts and copies r1 (one lineage, however the copies
    # ran), r2 goes bad on its own. Two witnesses, one each: nobody wins, the job stops.
    good, bad = b"g" * 16, b"b" * 16
    verdict = judge([good, good, bad], lineages=[7, 7, 9])
    assert not verdict.repairable and set(verdict.divergent) == {0, 1, 2}
    # with a fourth replica of its own, the healthy state wins
    verdict = judge([good, good, bad, good], lineages=[7, 7, 9, 8])
    assert verdict.majority == (0, 1, 3) and verdict.divergent == (2,)


def test_three_healthy_lineages_repair_one_corruption():
    a, b = b"a" * 16, b"b" * 16
    verdict = judge([a, a, a, b], lineages=[1, 2, 3, 4])
    assert verdict.majority == (0, 1, 2) and verdict.divergent == (3,)
    verdict = judge([a, a, b], lineages=[1, 2, 3])
    assert verdict.majority == (0, 1) and verdict.divergent == (2,)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 5]), st.booleans()), min_size=2,
                max_size=6), st.sampled_from([1, 2, 3, 4, 5]))
def test_a_corruption_never_wins_a_vote_it_does_not_hold_alone(members, bad_lineage):
    # A corruption starts in one replica and spreads only by copies, which take their
    # source's lineage: every replica holding it is of one lineage. However many hold it,
    # it wins only where no other state is held at all.
    good, bad = b"g" * 16, b"b" * 16
    digests = [bad if corrupt else good for _, corrupt in members]
    lineages = [bad_lineage if corrupt else lineage for lineage, corrupt in members]
    verdict = judge(digests, lineages)
    if good in digests:
        assert not any(digests[i] == bad for i in verdict.majority), (digests, lineages)


def test_a_copy_joins_its_donors_lineage_except_at_the_start_and_from_a_verified_state():
    assert copy_inherits_lineage(MemberRow(step=40, chain=CHAINS[1]))
    # the job's start: the donor defines the initial state, every receiver is a witness
    assert not copy_inherits_lineage(MemberRow(step=0, chain=CHAINS[0], fresh=True))
    # a repair receives the state the comparison just found right
    assert not copy_inherits_lineage(MemberRow(step=60, chain=CHAINS[1], verified=True))


def test_a_split_says_who_holds_which_state_and_how_many_votes():
    a, b = b"a" * 16, b"b" * 16
    assert describe_split([a, a, b], [7, 7, 9], ["r0", "r1", "r2"]) == (
        "r0, r1 hold one state (1 vote: they copied it from one another); r2 holds another "
        "(1 vote)")
    assert describe_split([a, b, a], [1, 2, 3], ["r0", "r1", "r2"]) == (
        "r0, r2 hold one state (2 votes); r1 holds another (1 vote)")
