"""The stop-string hold-back of the incremental detokenizer: the same answer as the definition
(the longest tail that is a prefix of a stop string), in time linear in the output."""

from __future__ import annotations

import time

import hypothesis.strategies as st
from hypothesis import given, settings

from tandem.runtime.detokenizer import IncrementalDetokenizer


class Chars:
    """A tokenizer whose token id is a character's code point."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(map(chr, ids))


def definition(text: str, stops: list[str]) -> int:
    hold = max(len(s) for s in stops) - 1
    for n in range(min(hold, len(text)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text("ab", min_size=1, max_size=8), min_size=1, max_size=4),
    st.lists(st.text("abc", min_size=1, max_size=3), max_size=30),
)
def test_held_back_matches_its_definition(stops: list[str], pieces: list[str]) -> None:
    detok = IncrementalDetokenizer(Chars(), [], stops)
    emitted = ""
    for piece in pieces:
        emitted += detok.add_tokens([ord(c) for c in piece])
        if detok.stop_matched is not None:
            break
        assert detok._held_back() == definition(detok.text, stops), (detok.text, stops)
        assert detok.text.startswith(emitted)


def _cost(stop: str, num_tokens: int) -> float:
    detok = IncrementalDetokenizer(Chars(), [], [stop])
    t0 = time.perf_counter()
    for i in range(num_tokens):
        detok.add_tokens([ord("ab"[i % 2])])  # no tail ending in "b" starts the stop string
    return time.perf_counter() - t0


def test_a_long_stop_string_costs_time_linear_in_the_output() -> None:
    stop = "a" * 20_000 + "b"
    short, long = _cost(stop, 500), _cost(stop, 1_500)
    # before: each token tried every tail length, slicing each: 3x the tokens took ~20x the
    # time, about a second here
    assert long < 6 * short + 0.05 and long < 0.5, (short, long)
