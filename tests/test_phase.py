"""The replica's phase: one value, and only the moves its diagram has."""

from __future__ import annotations

import pytest

from ftsystem.training.phase import ALLOWED, Lifecycle, Phase, PhaseError


def test_a_joiner_goes_through_warm_up_catch_up_and_its_join_step_to_member():
    life = Lifecycle("r1")
    for phase in (Phase.WARMING, Phase.CATCHING_UP, Phase.JOINING, Phase.JOIN_STEP,
                  Phase.MEMBER, Phase.REPAIRING, Phase.MEMBER, Phase.FINISHING,
                  Phase.FINISHED):
        life.move(phase)
    assert life.is_(Phase.FINISHED) and life.done


def test_a_move_the_diagram_does_not_have_is_refused_where_it_happens():
    life = Lifecycle("r1")
    with pytest.raises(PhaseError, match="r1: cannot go from new to member"):
        life.move(Phase.MEMBER)  # a member that never entered an epoch
    life.move(Phase.JOINING)
    life.move(Phase.MEMBER)
    with pytest.raises(PhaseError, match="from member to join-step"):
        life.move(Phase.JOIN_STEP)  # a member offering a join step again
    assert life.is_(Phase.MEMBER) and not life.done


def test_every_phase_is_reachable_from_new_and_finished_is_the_end():
    reached, frontier = {Phase.NEW}, [Phase.NEW]
    while frontier:
        for nxt in ALLOWED[frontier.pop()] - reached:
            reached.add(nxt)
            frontier.append(nxt)
    assert reached == set(Phase) and not ALLOWED[Phase.FINISHED]
