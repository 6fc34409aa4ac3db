"""Which peers a head vets before it plans (discovery/pool.py): the peers file's always; those
typed with --peer only when the command asks (`vet_typed`: serve and batch start on the peers that
answer and ask the others again), else they fail loudly when dialled; `PeerFinder.again` always,
so that a typed peer down at the start is no newcomer until it answers."""

from __future__ import annotations

from potluck.discovery.pool import PeerFinder, gather
from potluck.discovery.static import CONFIG, STATIC, Peer

UP, DOWN = Peer("10.0.0.2:50052", STATIC), Peer("10.0.0.3:50052", STATIC)
FILED = Peer("10.0.0.4:50052", CONFIG)  # in the peers file, down
PEERS = [UP, DOWN, FILED]


def _vet(answering: set[str]):
    return lambda p: "" if p.address in answering else "it does not accept connections"


def test_typed_peers_pass_unvetted_unless_asked() -> None:
    vet = _vet({UP.address})
    found = gather(PEERS, [], "home", vet)
    assert found.peers == (UP, DOWN)  # DOWN fails loudly when the head dials it (run, chat)
    assert found.skipped == ((FILED, "it does not accept connections"),)
    found = gather(PEERS, [], "home", vet, vet_typed=True)
    assert found.peers == (UP,)
    assert [p for p, _ in found.skipped] == [DOWN, FILED]


def test_a_finder_vets_typed_peers_when_made_to() -> None:
    vet = _vet({UP.address})
    assert PeerFinder(PEERS, "home", None).find(vet).peers == (UP, DOWN)
    assert PeerFinder(PEERS, "home", None, vet_typed=True).find(vet).peers == (UP,)


def test_again_leaves_out_a_typed_peer_until_it_answers() -> None:
    """A server's Recruiter asks again() for newcomers: a typed peer that is down is skipped (not
    found and then marked as tried), and found once it answers."""
    answering = {UP.address}
    finder = PeerFinder(PEERS, "home", None)
    finder.find(_vet(answering))
    assert finder.again(_vet(answering)).peers == (UP,)
    answering.add(DOWN.address)
    assert finder.again(_vet(answering)).peers == (UP, DOWN)
