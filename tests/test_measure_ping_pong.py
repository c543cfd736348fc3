"""measure.ping_pong keeps each message size's quickest round trip, timed by the rank that starts
them: on a fake clock and a fake transport, a scheduling stall in one repeat no longer moves the
fitted link, and the other rank returns the starting rank's figures."""
import pytest
import torch

from hrlplan import measure

BANDWIDTH, LATENCY, STALL_S = 1e9, 20e-6, 0.05
SIZES = (1 << 12, 1 << 20)


class FakeLink:
    """dist.send / dist.recv on a fake clock: each message takes LATENCY + bytes / BANDWIDTH; the
    `stall_at`-th transfer (counting from 0) takes STALL_S more. `figures`: what the other rank sends
    as its one-way times (the float64 tensor ping_pong shares after its round trips)."""

    def __init__(self, stall_at=None, figures=None):
        self.clock, self.transfers, self.stall_at, self.figures = 0.0, 0, stall_at, figures
        self.shared = None

    def perf_counter(self) -> float:
        return self.clock

    def _move(self, t: torch.Tensor) -> None:
        self.clock += LATENCY + t.numel() * t.element_size() / BANDWIDTH
        if self.transfers == self.stall_at:
            self.clock += STALL_S
        self.transfers += 1

    def send(self, t, peer):
        if t.dtype == torch.float64:
            self.shared = t.tolist()
            return
        self._move(t)

    def recv(self, t, peer):
        if t.dtype == torch.float64:
            t.copy_(torch.tensor(self.figures, dtype=torch.float64))
            return
        self._move(t)


@pytest.fixture
def fake(monkeypatch):
    def install(**kwargs):
        link = FakeLink(**kwargs)
        monkeypatch.setattr(measure.dist, "send", link.send)
        monkeypatch.setattr(measure.dist, "recv", link.recv)
        monkeypatch.setattr(measure.time, "perf_counter", link.perf_counter)
        return link
    return install


def test_an_undisturbed_link_is_fitted_exactly(fake):
    link = fake()
    bw, lat = measure.ping_pong(0, 1, SIZES, 3, torch.device("cpu"))
    assert bw == pytest.approx(BANDWIDTH) and lat == pytest.approx(LATENCY)
    assert link.shared == pytest.approx([LATENCY + n / BANDWIDTH for n in SIZES])


# transfers 0-1 are the warm-up, 2-7 the small size's 3 round trips, 8-13 the big size's
@pytest.mark.parametrize("stall_at", [2, 5, 9])
def test_a_stall_in_one_repeat_does_not_move_the_figure(fake, stall_at):
    """With the mean of the 3 repeats, a 50 ms stall made the small message 8 ms one way and the
    link's fit nonsense (the round-5 ping_pong)."""
    link = fake(stall_at=stall_at)
    bw, lat = measure.ping_pong(0, 1, SIZES, 3, torch.device("cpu"))
    assert link.transfers == 2 + 2 * 3 * len(SIZES)
    assert bw == pytest.approx(BANDWIDTH) and lat == pytest.approx(LATENCY)


def test_the_rank_that_answers_returns_the_starting_rank_s_figures(fake):
    """Its own intervals are not round trips (and here one holds a stall): it fits what rank 0 sent."""
    theirs = [2 * LATENCY + n / (BANDWIDTH / 2) for n in SIZES]
    fake(stall_at=4, figures=theirs)
    bw, lat = measure.ping_pong(1, 0, SIZES, 3, torch.device("cpu"))
    assert bw == pytest.approx(BANDWIDTH / 2) and lat == pytest.approx(2 * LATENCY)
