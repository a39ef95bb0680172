"""The group policy: the decision for a whole group, and the book that holds rows until it is whole."""

from __future__ import annotations

from policy import GroupAction, GroupBook, GroupMode, decide_group


def _decide(mode, masked, resubmits_done=0, max_resubmits=1, budget_left=100):
    return decide_group(
        GroupMode(mode),
        masked,
        resubmits_done=resubmits_done,
        max_resubmits=max_resubmits,
        budget_left=budget_left,
    )


def test_none_keeps_every_row_and_a_clean_group_is_kept_in_every_mode():
    assert _decide("none", [True, False]).action is GroupAction.KEEP
    for mode in ("mask_group", "resubmit_group"):
        assert _decide(mode, [False, False, False]).action is GroupAction.KEEP


def test_mask_group_masks_all_when_any_is_masked():
    verdict = _decide("mask_group", [False, True, False, False])
    assert verdict.action is GroupAction.MASK and "1 of 4 samples masked" in verdict.reason


def test_resubmit_group_reruns_within_its_count_and_the_budget_then_masks():
    assert _decide("resubmit_group", [True, False]).action is GroupAction.RESUBMIT
    used = _decide("resubmit_group", [True, False], resubmits_done=1)
    assert used.action is GroupAction.MASK and "resubmits used" in used.reason
    broke = _decide("resubmit_group", [True, False, False], budget_left=2)  # a rerun costs 3 attempts
    assert broke.action is GroupAction.MASK and "budget" in broke.reason


def test_book_releases_a_group_only_when_whole_and_honours_a_smaller_expectation():
    book: GroupBook[str] = GroupBook()
    book.expect("t1", 3)
    book.expect("t2", 1)  # a resume that found two of t2's samples already final
    assert book.hold("t1", 2, "r2", False) is None
    assert book.hold("t1", 0, "r0", True) is None
    assert book.held_rows == 2
    assert book.hold("t2", 1, "x", False) == [(1, "x", False)]
    whole = book.hold("t1", 1, "r1", False)
    assert whole == [(0, "r0", True), (1, "r1", False), (2, "r2", False)]
    assert book.held_rows == 0
    book.resubmitted("t1")
    assert book.resubmits("t1") == 1
    assert book.hold("t1", 0, "again", False) is None  # after a resubmit the whole group is awaited again
    book.close("t1")
    assert book.resubmits("t1") == 0
