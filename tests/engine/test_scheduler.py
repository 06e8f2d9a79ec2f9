"""Scheduler policy on fake capacity: decodes first, chunked prefill within the budget, FIFO."""

from engine.core.scheduler import Scheduler, SchedRequest


class Capacity:
    def __init__(self, slots):
        self.slots = slots
        self.admitted = []

    def admit(self, rid):
        if self.slots == 0:
            return False
        self.slots -= 1
        self.admitted.append(rid)
        return True


def test_budget_chunks_and_decodes_first():
    cap = Capacity(10)
    s = Scheduler(token_budget=10, max_seqs=8)
    s.add(SchedRequest("a", 25))
    s.add(SchedRequest("b", 3))
    out = s.schedule(cap.admit)
    assert [(c.request_id, c.num_tokens, c.prefill_done) for c in out.chunks] == [("a", 10, False)]
    assert out.admitted == ["a"]
    out = s.schedule(cap.admit)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 10)]
    out = s.schedule(cap.admit)  # a finishes its prompt (5), b is admitted with 3, within budget 10
    assert [(c.request_id, c.num_tokens, c.prefill_done) for c in out.chunks] == [("a", 5, True), ("b", 3, True)]
    out = s.schedule(cap.admit)  # both decode
    assert [(c.request_id, c.num_tokens, c.decode) for c in out.chunks] == [("a", 1, True), ("b", 1, True)]
    s.remove("a")
    assert [c.request_id for c in s.schedule(cap.admit).chunks] == ["b"]



def test_a_prompt_a_step_takes_whole_is_not_split_behind_other_prompts():
    cap = Capacity(10)
    s = Scheduler(token_budget=10, max_seqs=8)
    for rid, n in (("a", 6), ("b", 6), ("c", 3), ("d", 25)):
        s.add(SchedRequest(rid, n))
    out = s.schedule(cap.admit)  # b fits a step whole, not the 4 tokens left: it starts the next
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 6)] and out.admitted == ["a"]
    out = s.schedule(cap.admit)  # a decodes; b whole, and c whole in what is left
    assert [(c.request_id, c.num_tokens, c.decode or c.prefill_done) for c in out.chunks] == [
        ("a", 1, True), ("b", 6, True), ("c", 3, True)]
    out = s.schedule(cap.admit)  # d is longer than any step: chunked in what the decodes leave
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 1), ("d", 7)]


def test_fifo_admission_and_row_limit():
    cap = Capacity(1)
    s = Scheduler(token_budget=100, max_seqs=8)
    for rid in "xyz":
        s.add(SchedRequest(rid, 4))
    out = s.schedule(cap.admit)
    assert out.admitted == ["x"] and s.num_waiting == 2
    cap.slots = 5
    cap2 = Capacity(5)
    s2 = Scheduler(token_budget=100, max_seqs=2)
    for rid in "pqr":
        s2.add(SchedRequest(rid, 4))
    assert len(s2.schedule(cap2.admit).chunks) == 2  # per-step row limit
    assert not s.is_waiting("x") and s.is_waiting("y")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def shape(out):
    return [(c.request_id, c.num_tokens, c.decode) for c in out.chunks]


def test_prompts_take_the_budget_first_while_the_stall_bound_allows():
    cap, clock = Capacity(10), Clock()
    s = Scheduler(token_budget=8, max_seqs=8, max_decode_stall_s=1.0, clock=clock)
    s.add(SchedRequest("a", 8))
    assert shape(s.schedule(cap.admit)) == [("a", 8, False)]  # a's whole prompt: a decodes next
    for rid in "bcd":
        s.add(SchedRequest(rid, 8))
    # a burst of prompts: a pauses while they fill whole steps
    for rid in "bcd":
        clock.now += 0.3
        assert shape(s.schedule(cap.admit)) == [(rid, 8, False)]
    # 0.9 s since a's last token: still within the bound, but nothing waits: everyone decodes
    clock.now += 0.05
    assert shape(s.schedule(cap.admit)) == [(r, 1, True) for r in "abcd"]
    s.add(SchedRequest("e", 6))  # a prompt that leaves room: decoding rows take the rest, oldest first
    assert shape(s.schedule(cap.admit)) == [("a", 1, True), ("b", 1, True), ("e", 6, False)]


def test_a_burst_of_whole_prompts_pauses_decoding_rows_once():
    """Prompts that a step takes whole leave part of each burst step unused; the decoding rows do
    not take it (each such step would be a long gap of theirs), until the burst ends or the bound
    passes."""
    cap, clock = Capacity(10), Clock()
    s = Scheduler(token_budget=10, max_seqs=8, max_decode_stall_s=1.0, clock=clock)
    s.add(SchedRequest("a", 6))
    s.schedule(cap.admit)
    for rid in "bcd":
        s.add(SchedRequest(rid, 6))
    for rid in "bc":  # 4 tokens left in each, short of the next prompt: nobody decodes
        clock.now += 0.1
        assert shape(s.schedule(cap.admit)) == [(rid, 6, False)]
    clock.now += 0.1
    assert shape(s.schedule(cap.admit)) == [("a", 1, True), ("b", 1, True), ("c", 1, True), ("d", 6, False)]
    assert shape(s.schedule(cap.admit)) == [(r, 1, True) for r in "abcd"]
    s.add(SchedRequest("e", 6))
    s.add(SchedRequest("f", 6))
    assert shape(s.schedule(cap.admit)) == [("e", 6, False)]
    clock.now += 1.1  # past the bound since the rows last decoded: they decode first, f whole in the rest
    assert shape(s.schedule(cap.admit)) == [(r, 1, True) for r in "abcde"] + [("f", 5, False)]


def test_a_row_stalled_past_the_bound_decodes_first():
    cap, clock = Capacity(10), Clock()
    s = Scheduler(token_budget=8, max_seqs=8, max_decode_stall_s=1.0, clock=clock)
    s.add(SchedRequest("a", 8))
    s.schedule(cap.admit)
    s.add(SchedRequest("long", 80))
    stalled = 0
    while True:
        out = s.schedule(cap.admit)
        if any(c.decode for c in out.chunks):
            break
        stalled += 1
        clock.now += 0.4
    # the step after the bound passed: a's token first, the long prompt gets the rest
    assert stalled == 3 and shape(out) == [("a", 1, True), ("long", 7, False)]
    clock.now += 0.4
    assert shape(s.schedule(cap.admit)) == [("long", 8, False)]  # the bound starts over


def test_without_a_stall_bound_decodes_come_first_every_step():
    cap = Capacity(10)
    s = Scheduler(token_budget=8, max_seqs=8)
    s.add(SchedRequest("a", 8))
    s.schedule(cap.admit)
    s.add(SchedRequest("b", 16))
    assert shape(s.schedule(cap.admit)) == [("a", 1, True), ("b", 7, False)]
    assert shape(s.schedule(cap.admit)) == [("a", 1, True), ("b", 7, False)]


def test_a_prompt_that_cannot_be_admitted_does_not_stall_decoding():
    cap, clock = Capacity(1), Clock()
    s = Scheduler(token_budget=8, max_seqs=8, max_decode_stall_s=10.0, clock=clock)
    s.add(SchedRequest("a", 4))
    s.schedule(cap.admit)
    s.add(SchedRequest("b", 4))  # no room until a ends
    assert shape(s.schedule(cap.admit)) == [("a", 1, True)]
    assert s.is_waiting("b")
