"""The routing policies as pure choices over replicas with set loads (no processes)."""

from __future__ import annotations

import random

import pytest

from router.config import RouterConfig
from router.pending import PendingPrefixes
from router.policies import Policies, RouteInput, load_cap, rendezvous_order, under_cap
from router.replicas import Replica, ReportedLoad

BLOCK = 16


def replicas(*active: int) -> list[Replica]:
    out = []
    for i, n in enumerate(active):
        r = Replica.__new__(Replica)  # no channel: policies read only names and loads
        r.address, r.engine_id = f"127.0.0.1:{5000 + i}", f"engine-{i}"
        r.in_flight, r.pending_prefill_tokens, r.pending_prompt_tokens = n, 0, 0
        r.prefilled_prompt_tokens = r.reported_after_prefilled = 0
        r.reported = ReportedLoad()
        r.num_finished = r.reported_after_finished = 0
        out.append(r)
    return out


def test_kv_aware_prefers_the_replica_holding_the_prefix():
    rs = replicas(1, 1, 1)
    route = RouteInput(320, b"k" * 16, {"engine-2": 19})
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.replica.engine_id == "engine-2" and decision.matched_blocks == 19
    assert not decision.fallback


def test_a_load_report_older_than_a_finished_request_does_not_push_its_prefix_away():
    """The holder's last EngineStats was taken while the request that cached the prefix was
    still queued (its whole prompt counted as waiting prefill); that request has ended since.
    Until the next poll the router counts its own requests there, and the next request with the
    prefix goes to the holder."""
    rs = replicas(0, 0)
    holder = rs[0]
    holder.reported = ReportedLoad(waiting_prefill_tokens=13 * BLOCK, running_seqs=1,
                                   live_requests=1)
    route = RouteInput(13 * BLOCK, b"k" * 16, {"engine-0": 12})
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is rs[1]
    holder.num_finished += 1  # the request ended after that report was asked for
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.replica is holder and decision.matched_blocks == 12
    holder.reported_after_finished = holder.num_finished  # a poll after it: trusted again
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is rs[1]


def test_our_queued_requests_count_their_uncached_part_only():
    """The engine reports a waiting prompt whole, its cached prefix too. Three of our requests
    for a hot prefix wait on its holder (2 uncached blocks each, 34 blocks whole): the holder
    is 6 blocks busier, not 102, and the next request for the prefix stays there. Another
    client's queue there (reported past ours) counts as reported."""
    rs = replicas(3, 3)
    holder = rs[0]
    holder.pending_prefill_tokens = 3 * 2 * BLOCK
    holder.pending_prompt_tokens = 3 * 34 * BLOCK
    holder.reported = ReportedLoad(waiting_prefill_tokens=3 * 34 * BLOCK, live_requests=3)
    assert holder.queued_prefill_tokens == 6 * BLOCK
    route = RouteInput(34 * BLOCK, b"k" * 16, {"engine-0": 32})
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is holder
    holder.reported = ReportedLoad(waiting_prefill_tokens=(3 * 34 + 60) * BLOCK,
                                   live_requests=5)
    assert holder.queued_prefill_tokens == (6 + 60) * BLOCK  # 60 blocks of someone else's
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is rs[1]
    # A report asked for before one of ours got its first message still counts that prompt
    # whole: it is ours, not another client's, until the next report.
    holder.reported = ReportedLoad(waiting_prefill_tokens=3 * 34 * BLOCK, live_requests=3)
    holder.pending_prefill_tokens, holder.pending_prompt_tokens = 2 * 2 * BLOCK, 2 * 34 * BLOCK
    holder.prefilled_prompt_tokens += 34 * BLOCK  # (reported_after_prefilled: before it)
    assert holder.queued_prefill_tokens == 4 * BLOCK
    holder.reported_after_prefilled = holder.prefilled_prompt_tokens  # a poll after it
    holder.reported = ReportedLoad(waiting_prefill_tokens=2 * 34 * BLOCK, live_requests=3)
    assert holder.queued_prefill_tokens == 4 * BLOCK
    # A report smaller than our own queue (asked before ours arrived): nobody else's work.
    holder.reported = ReportedLoad(waiting_prefill_tokens=0, live_requests=0)
    assert holder.queued_prefill_tokens == 4 * BLOCK
    # A report older than a request of ours that ended: our own count alone until the next.
    holder.num_finished += 1
    assert holder.queued_prefill_tokens == 4 * BLOCK


def test_kv_aware_spills_when_the_holder_has_more_queued_prefill_than_the_prefix_saves():
    rs = replicas(1, 1)
    rs[0].pending_prefill_tokens = 40 * BLOCK  # 40 blocks queued vs 20 saved
    route = RouteInput(320, b"k" * 16, {"engine-0": 20})
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.replica.engine_id == "engine-1"


def test_bounded_load_caps_a_hot_prefix():
    rs = replicas(5, 1, 0)  # total 6: cap = ceil(1.25 * 7 / 3) = 3, + the default slack 2
    assert load_cap(rs, 1.25) == 3 and load_cap(rs, 1.25, 2) == 5
    assert [r.engine_id for r in under_cap(rs, 1.25)] == ["engine-1", "engine-2"]
    route = RouteInput(320, b"k" * 16, {"engine-0": 20})
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.replica.engine_id != "engine-0"


def test_a_second_request_for_a_prefix_stays_with_its_holder_at_low_load():
    """One request running, on the replica holding the prefix: the bound alone (cap
    ceil(1.25 * 2 / 3) = 1) would send the next one for the prefix elsewhere, to prefill it
    again and evict another tenant's prefix for it; the slack keeps it with the holder."""
    rs = replicas(1, 0, 0)
    route = RouteInput(34 * BLOCK, b"k" * 16, {"engine-0": 32})
    assert load_cap(rs, 1.25) == 1
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.replica.engine_id == "engine-0" and decision.matched_blocks == 32
    strict = Policies(RouterConfig(load_slack=0)).choose("kv-aware", rs, route, BLOCK)
    assert strict.replica.engine_id != "engine-0"


def test_a_prefix_nobody_holds_goes_to_its_rendezvous_home_unless_it_is_loaded():
    """Cold prefixes spread over the replicas by hash (each replica caches its share of them)
    rather than all going to whichever replica is idlest at the moment; a home with more
    work queued than home_weight blocks is passed by."""
    rs = replicas(0, 0, 0)
    rs[0].reported = ReportedLoad(kv_usage=0.5)  # a little busier, by 4 blocks of cost
    rs[1].reported = ReportedLoad(kv_usage=0.25)
    policies = Policies(RouterConfig())
    homes = set()
    for n in range(30):
        key = bytes([n]) * 16
        home = rendezvous_order(key, rs)[0]
        homes.add(home.engine_id)
        decision = policies.choose("kv-aware", rs, RouteInput(34 * BLOCK, key, {}), BLOCK)
        assert decision.replica is home, n
    assert homes == {"engine-0", "engine-1", "engine-2"}
    key = bytes([0]) * 16
    home = rendezvous_order(key, rs)[0]
    home.pending_prefill_tokens = 20 * BLOCK
    decision = policies.choose("kv-aware", rs, RouteInput(34 * BLOCK, key, {}), BLOCK)
    assert decision.replica is not home


def test_pending_prefixes_credit_a_routed_chain_until_they_expire():
    pending = PendingPrefixes(ttl_s=5.0)
    chain = [bytes([i]) * 16 for i in range(6)]
    other = [b"x" * 16, *chain[1:]]  # another first block: shares nothing
    pending.add(chain[:4], now=100.0)
    assert pending.matched(chain, now=101.0) == 4
    assert pending.matched(chain[:2], now=101.0) == 2
    assert pending.matched(other, now=101.0) == 0
    pending.add(chain, now=103.0)  # routed again: the whole chain, for longer
    assert pending.matched(chain, now=104.9) == 6
    assert pending.matched(chain, now=107.5) == 6  # the first credit ended, not the second
    assert pending.matched(chain, now=108.0) == 0 and len(pending) == 0


def test_index_down_falls_back_to_prefix_hash_with_bounded_load():
    rs = replicas(0, 0, 0)
    route = RouteInput(320, b"some-prefix-key!", None)
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.fallback and decision.policy == "prefix-hash-bounded"
    home = rendezvous_order(b"some-prefix-key!", rs)[0]
    assert decision.replica is home
    home.in_flight = 6  # past the cap (ceil(1.25 * 7 / 3) + 2 = 5): the next in its order
    decision = Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK)
    assert decision.replica is rendezvous_order(b"some-prefix-key!", rs)[1]


def test_an_unread_prompt_with_the_index_down_goes_by_load_under_the_fallback():
    """No key to hash and no index answer: the fallback spreads by load, and says it is the
    fallback (metrics and the pagedgen-route trailer read these)."""
    rs = replicas(0, 0, 0)
    rs[0].pending_prefill_tokens = rs[1].pending_prefill_tokens = 40 * BLOCK
    policies = Policies(RouterConfig())
    for _ in range(3):
        decision = policies.choose("kv-aware", rs, RouteInput(None, None, None), BLOCK)
        assert decision.replica is rs[2]
        assert decision.fallback and decision.policy == "prefix-hash-bounded"


def test_prefix_hash_is_stateless_and_prefix_hash_bounded_is_not():
    """prefix-hash (the issue's baseline: a router that knows neither caches nor load) sends
    every request for a prefix to its rendezvous home however loaded that is; the bounded
    variant (kv-aware's fallback) passes a home over the load cap by."""
    rs = replicas(0, 0, 0)
    key = b"some-prefix-key!"
    order = rendezvous_order(key, rs)
    order[0].in_flight, order[1].in_flight = 40, 1
    order[0].pending_prefill_tokens = 100 * BLOCK
    policies = Policies(RouterConfig())
    route = RouteInput(320, key, {})
    for _ in range(5):
        decision = policies.choose("prefix-hash", rs, route, BLOCK)
        assert decision.replica is order[0] and decision.policy == "prefix-hash"
        assert not decision.fallback
    bounded = policies.choose("prefix-hash-bounded", rs, route, BLOCK)
    assert bounded.replica is order[1] and bounded.policy == "prefix-hash-bounded"
    assert not bounded.fallback
    # An unread prompt has no key: prefix-hash takes the replicas in turn, load unseen.
    unread = RouteInput(None, None, None)
    picked = [policies.choose("prefix-hash", rs, unread, BLOCK).replica for _ in range(6)]
    assert sorted(r.engine_id for r in picked) == sorted(r.engine_id for r in rs * 2)


def test_rendezvous_moves_only_the_keys_of_a_removed_replica():
    rs = replicas(0, 0, 0, 0)
    rng = random.Random(7)
    keys = [rng.randbytes(16) for _ in range(400)]
    before = {k: rendezvous_order(k, rs)[0].engine_id for k in keys}
    after = {k: rendezvous_order(k, rs[:3])[0].engine_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "engine-3" for k in moved)
    shares = {e: list(before.values()).count(e) for e in set(before.values())}
    assert min(shares.values()) > 60  # spread over all four


def test_round_robin_and_least_load():
    rs = replicas(3, 0, 2)
    policies = Policies(RouterConfig())
    route = RouteInput(32, None, None)
    assert policies.choose("least-load", rs, route, BLOCK).replica.engine_id == "engine-1"
    picked = [policies.choose("round-robin", rs, route, BLOCK).replica.engine_id
              for _ in range(6)]
    assert sorted(picked) == sorted(["engine-0", "engine-1", "engine-2"] * 2)


def test_ties_rotate_over_equal_replicas():
    rs = replicas(0, 0, 0)
    policies = Policies(RouterConfig())
    route = RouteInput(32, None, {})
    picked = {policies.choose("kv-aware", rs, route, BLOCK).replica.engine_id
              for _ in range(3)}
    assert picked == {"engine-0", "engine-1", "engine-2"}


@pytest.mark.parametrize("field,value", [("policy", "random"), ("load_bound", 0.9),
                                         ("prefill_weight", -1.0), ("prefix_hash_blocks", 0),
                                         ("load_slack", -1)])
def test_bad_settings_are_named(field, value):
    config = RouterConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        config.check()


def _home_of(key: bytes, rs: list[Replica]) -> Replica:
    return rendezvous_order(key, rs)[0]


def test_a_new_prefix_goes_past_the_replica_that_serves_a_hot_prefix():
    """One replica took 70% of the recent requests (a hot prefix lives there). A prompt nobody
    holds, whose rendezvous home is that replica, would stall the hot traffic behind its
    prefill there: it goes to another replica. With the traffic even, its home takes it."""
    rs = replicas(1, 1, 1)
    key = next(k for k in (bytes([i]) * 16 for i in range(256)) if _home_of(k, rs) is rs[0])
    route_even = RouteInput(34 * BLOCK, key, {}, {r.name: 1 / 3 for r in rs})
    # (Off by default: --hot-replica-weight 2 is the weight the bench ran.)
    policies = Policies(RouterConfig(hot_replica_weight=2.0))
    assert policies.choose("kv-aware", rs, route_even, BLOCK).replica is rs[0]
    # Noise in an even split (45% of the window) is no reason to pass the home by.
    noisy = {rs[0].name: 0.45, rs[1].name: 0.3, rs[2].name: 0.25}
    assert policies.choose("kv-aware", rs, RouteInput(34 * BLOCK, key, {}, noisy),
                           BLOCK).replica is rs[0]
    hot = {rs[0].name: 0.7, rs[1].name: 0.15, rs[2].name: 0.15}
    decision = policies.choose("kv-aware", rs, RouteInput(34 * BLOCK, key, {}, hot), BLOCK)
    assert decision.replica is not rs[0]
    # The hot prefix itself stays where it is cached: its uncached user turn is two blocks;
    # so does a prompt with most of its blocks cached there (20 of 34).
    for held in (32, 20):
        hot_route = RouteInput(34 * BLOCK, b"h" * 16, {rs[0].engine_id: held}, hot)
        assert policies.choose("kv-aware", rs, hot_route, BLOCK).replica is rs[0], held
    # Off (the default, weight 0): the home takes it whatever the shares.
    off = Policies(RouterConfig())
    assert off.choose("kv-aware", rs, RouteInput(34 * BLOCK, key, {}, hot), BLOCK).replica is rs[0]


def test_recent_routes_count_the_last_window_of_recent_decisions():
    from router.recent_routes import RecentRoutes

    recent = RecentRoutes(8, max_age_s=60.0)  # shares over at least 2 decisions
    recent.add("a", 0.0)
    assert recent.shares(0.0) == {"a": 0.5}  # one decision is not a 100% share
    for name in ["a", "b", "a", "c", "c", "a", "b", "c", "c"]:
        recent.add(name, 1.0)
    assert len(recent) == 8  # the first "a" and the next one dropped
    assert recent.shares(1.0) == {"b": 0.25, "a": 0.25, "c": 0.5}
    assert recent.shares(61.5) == {}  # a quiet minute: nothing recent
    with pytest.raises(ValueError, match="window must be >= 1"):
        RecentRoutes(0)
    with pytest.raises(ValueError, match="share_window must be >= 1"):
        RouterConfig(share_window=0).check()
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="hot_replica_weight must be a finite number >= 0"):
            RouterConfig(hot_replica_weight=bad).check()


def test_a_new_prefix_goes_where_the_pool_has_room_for_it():
    """Recent prefixes fill one replica's pool (128 blocks: three prefixes of 34 blocks sent
    there lately) and not the other's: a new 34-block prefix whose rendezvous home is the
    full one would evict a prefix its traffic comes back for, so it goes where there is
    room. Each evicted block costs --room-weight blocks; 0 turns it off."""
    rs = replicas(0, 0)
    for r in rs:
        r.reported = ReportedLoad(num_blocks=128)
    full, roomy = rs
    key = next(k for k in (bytes([i]) * 16 for i in range(256)) if _home_of(k, rs) is full)
    route = RouteInput(34 * BLOCK, key, {}, None, {full.name: 3 * 34, roomy.name: 34})
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is roomy
    off = Policies(RouterConfig(room_weight=0.0))
    assert off.choose("kv-aware", rs, route, BLOCK).replica is full  # the home bonus
    # Room for it beside the others (two of them): the home takes it.
    route = RouteInput(34 * BLOCK, key, {}, None, {full.name: 2 * 34, roomy.name: 34})
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is full
    # A prefix the full replica holds costs its user turn there, and evicts nothing more.
    held = RouteInput(34 * BLOCK, key, {full.engine_id: 32}, None,
                      {full.name: 3 * 34, roomy.name: 34})
    assert Policies(RouterConfig()).choose("kv-aware", rs, held, BLOCK).replica is full
    # A pool not reported yet (0 blocks): no room term.
    for r in rs:
        r.reported = ReportedLoad()
    route = RouteInput(34 * BLOCK, key, {}, None, {full.name: 3 * 34, roomy.name: 34})
    assert Policies(RouterConfig()).choose("kv-aware", rs, route, BLOCK).replica is full


def test_recent_prefixes_count_each_prefix_once_per_replica():
    from router.recent_prefixes import RecentPrefixes

    recent = RecentPrefixes(4, max_age_s=60.0)
    recent.add("a", b"x", 40, 0.0)
    recent.add("a", b"x", 34, 1.0)  # the same prefix twice: counted once, its most blocks
    recent.add("a", b"y", 10, 1.0)
    recent.add("b", b"x", 34, 1.0)
    assert recent.blocks_of_others(b"z", 1.0) == {"a": 50, "b": 34}
    assert recent.blocks_of_others(b"x", 1.0) == {"a": 10}  # the request's own prefix aside
    recent.add("b", b"w", 5, 2.0)  # the window holds 4: the 40-block "x" on "a" drops
    assert recent.blocks_of_others(None, 2.0) == {"a": 44, "b": 39}
    assert recent.blocks_of_others(None, 61.5) == {"b": 5}  # older than a minute: gone
    recent.add("a", b"v", 3, 62.0)
    recent.add("b", b"u", 7, 62.0)
    recent.forget("b")  # "b" restarted: its pool is empty, "a"'s is not
    assert recent.blocks_of_others(None, 62.5) == {"a": 3}
    with pytest.raises(ValueError, match="window must be >= 1"):
        RecentPrefixes(0)
    with pytest.raises(ValueError, match="prefix_window must be >= 1"):
        RouterConfig(prefix_window=0).check()
    with pytest.raises(ValueError, match="room_weight must be a finite number >= 0"):
        RouterConfig(room_weight=-1.0).check()


def test_the_recent_window_keeps_the_last_items_of_the_last_seconds_in_order():
    from router.recent_window import RecentWindow

    window: RecentWindow[int] = RecentWindow(3, max_age_s=10.0)
    for n in range(5):
        window.add(n, float(n))
    assert window.items(4.0) == [2, 3, 4]  # the last 3, oldest first
    assert window.items(12.0) == [2, 3, 4]  # exactly 10 s old: still recent
    assert window.items(12.5) == [3, 4]  # 2 was added at 2.0: older than 10 s at 12.5
    window.drop(lambda n: n % 2 == 1)
    assert window.items(12.5) == [4] and len(window) == 1
    assert window.items(14.5) == []
