"""Calls or connections held open, by who holds them (common/slots.py): at most ``per_key``
each and ``total`` in all, a claim over either bound refused, a release that gives its slot
back once however often it runs. The outer optimizer's upload and download streams, the
health and reflection streams of every server and the HTTP endpoints' connections all count
through it; their own tests hold the bounds over real sockets."""

from __future__ import annotations

import threading

import pytest

from ddiloco.common.slots import Slots


def test_each_key_holds_at_most_its_bound_and_another_key_has_its_own():
    slots = Slots(per_key=2)
    a1, a2 = slots.claim(1), slots.claim(1)
    assert a1 is not None and a2 is not None
    assert slots.claim(1) is None and slots.full_for(1)
    assert slots.claim(2) is not None and not slots.full_for(2)
    assert slots.held(1) == 2 and slots.held() == 3


def test_the_total_bounds_every_key_together():
    slots = Slots(per_key=2, total=3)
    assert slots.claim("a") and slots.claim("a") and slots.claim("b")
    assert slots.claim("c") is None  # everyone's bound, not its own
    assert not slots.full_for("c")


def test_a_release_gives_its_slot_back_once_however_often_it_runs():
    slots = Slots(per_key=2)
    a1, a2 = slots.claim(1), slots.claim(1)
    a1()
    a1()  # a call's end callback and its finally may both run it
    assert slots.held(1) == 1
    assert slots.claim(1) is not None and slots.claim(1) is None
    a2()
    assert slots.held(1) == 1


def test_wait_held_returns_once_enough_slots_are_given_back():
    slots = Slots(per_key=2, total=3)
    releases = [slots.claim("a"), slots.claim("b")]
    assert not slots.wait_held(0, timeout=0)
    threads = [threading.Thread(target=r) for r in releases]
    for t in threads:
        t.start()
    assert slots.wait_held(0, timeout=10)
    for t in threads:
        t.join()
    assert slots.held() == 0


@pytest.mark.parametrize("per_key, total", [(0, None), (1, 0), (-1, 5)])
def test_a_bound_below_one_is_refused(per_key, total):
    with pytest.raises(ValueError, match="bounds >= 1"):
        Slots(per_key, total)
