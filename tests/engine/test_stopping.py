import random

from inference_api.engine.stopping import check_stop, held_back


def test_no_stops_sends_everything():
    assert check_stop("hello", ()).safe_len == 5


def test_match_cuts_before_first_occurrence():
    c = check_stop("say STOP now STOP", ("STOP",))
    assert c.stopped and c.safe_len == 4


def test_earliest_of_several_stops_wins():
    c = check_stop("a.b!c", ("!", "."))
    assert c.stopped and c.safe_len == 1


def test_prefix_of_a_stop_is_held_back():
    c = check_stop("hello wor", ("world",))
    assert not c.stopped and c.safe_len == 6


def test_longest_held_back_suffix():
    assert held_back("xxab", ("abc", "bcd")) == 2
    assert held_back("xxab", ("zzz",)) == 0
    assert held_back("xa", ("ab",)) == 1
    assert held_back("ab", ("ab",)) == 0  # a full match is not a proper prefix: check_stop catches it
    assert held_back("aaab", ("abab",)) == 2
    assert held_back("abab", ("ababc",)) == 4
    assert held_back("xaba", ("abaX",)) == 3
    assert held_back("ba", ("a", "ab")) == 1
    assert held_back("", ("ab",)) == 0


def test_held_back_equals_the_plain_scan_of_every_suffix():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        plain = max(
            [n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])],
            default=0,
        )
        assert held_back(text, stops) == plain, (text, stops)


def test_match_spanning_the_search_start():
    # "wor" was checked already (start=9); the match starting before start is still found
    c = check_stop("hello world", ("world",), start=9)
    assert c.stopped and c.safe_len == 6
