"""Stop strings over streamed deltas: spanning matches, hold-back, earliest match, flush."""

import pytest

from services.gateway.stop_strings import StopStringMatcher


def run(stops, deltas, include=False):
    matcher = StopStringMatcher(stops, include)
    released = []
    for delta in deltas:
        match = matcher.feed(delta)
        released.append(match.text)
        if match.stop is not None:
            return released, match.stop
    released.append(matcher.flush())
    return released, None


def test_no_stops_releases_everything_at_once():
    assert run([], ["ab", "cd"]) == (["ab", "cd", ""], None)


def test_text_ends_before_the_stop_string():
    released, stop = run(["END"], ["hello ", "wor", "ld END and more"])
    assert "".join(released) == "hello world "
    assert stop == "END"


def test_stop_string_spanning_deltas_is_found_and_never_leaked():
    released, stop = run(["\n\nUser:"], ["Hi", "\n", "\nUs", "er", ":", " more"])
    assert stop == "\n\nUser:"
    assert "".join(released) == "Hi"
    # The held-back start of the stop string never came out, not even in pieces.
    assert all("\n" not in part for part in released)


def test_hold_back_is_released_when_the_match_fails():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("xa").text == "x"   # "a" could start "abc"
    assert matcher.feed("b").text == ""     # "ab" still could
    assert matcher.feed("d").text == "abd"  # it did not
    assert matcher.flush() == ""


def test_flush_releases_a_partial_match_at_the_end():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed("zab").text == "z"
    assert matcher.flush() == "ab"


def test_earliest_occurrence_wins_over_list_order():
    released, stop = run(["world", "lo"], ["hello world"])
    assert (released, stop) == (["hel"], "lo")


def test_include_stop_string_in_output():
    released, stop = run(["END"], ["a E", "ND b"], include=True)
    assert ("".join(released), stop) == ("a END", "END")


def test_multibyte_stop_string():
    released, stop = run(["世界"], ["你好", "世", "界!"])
    assert ("".join(released), stop) == ("你好", "世界")


def test_overlapping_prefixes_hold_back_the_longest():
    matcher = StopStringMatcher(["aab", "ab"])
    assert matcher.feed("xaa").text == "x"
    match = matcher.feed("b")
    assert (match.text, match.stop) == ("", "aab")


def test_can_stop_false_releases_without_matching():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("END", can_stop=False).text == "END"
    assert matcher.feed("xEND").stop == "END"


def test_feeding_after_a_stop_releases_nothing():
    matcher = StopStringMatcher(["."])
    assert matcher.feed("a.b").stop == "."
    assert matcher.feed("more").text == ""


@pytest.mark.parametrize("chunking", [1, 2, 3, 7])
def test_result_does_not_depend_on_how_the_text_is_split(chunking):
    text = "The quick brown fox ### jumps"
    deltas = [text[i:i + chunking] for i in range(0, len(text), chunking)]
    released, stop = run(["###", "fox!"], deltas)
    assert ("".join(released), stop) == ("The quick brown fox ", "###")
