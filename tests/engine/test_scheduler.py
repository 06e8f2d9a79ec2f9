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
