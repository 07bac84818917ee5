"""`StepPlacement`: a step runs on the event loop's thread only when the steps before it predict it
short; a kind of step not seen yet, or one predicted long, goes to the step thread."""

import pytest

from services.engine.step_placement import StepPlacement


def test_nothing_seen_yet_runs_on_the_step_thread():
    placement = StepPlacement(inline_max_s=0.25)
    assert placement.predict(1, 1) is None and not placement.inline(1, 1)
    assert not placement.inline(1, 300)


def test_a_decode_step_like_a_short_one_runs_inline_and_a_long_one_does_not():
    placement = StepPlacement(inline_max_s=0.25)
    placement.observe(4, 4, 0.01)
    assert placement.inline(4, 4)
    assert placement.predict(8, 8) == pytest.approx(0.02)  # more rows: longer in proportion
    assert placement.predict(2, 2) == pytest.approx(0.01)  # fewer: no shorter than the last
    placement.observe(4, 4, 0.3)  # a large model's decode step
    assert not placement.inline(4, 4)


def test_prompt_tokens_are_predicted_from_the_last_step_that_had_some():
    placement = StepPlacement(inline_max_s=0.25)
    placement.observe(2, 2, 0.01)
    assert not placement.inline(3, 100)  # no prefill seen: unknown
    placement.observe(3, 101, 0.06)  # 98 prompt tokens beyond its rows in 0.05 s beyond the decodes
    assert placement.predict(3, 101) == pytest.approx(0.01 * 3 / 2 + 0.05)
    assert placement.inline(3, 101)
    assert not placement.inline(3, 2003)  # a long prompt's chunk: ~1 s
    assert placement.inline(2, 2)  # decodes still as the last decode step
