"""An engine SIGKILLed and restarted under its id, at the shipped index lease (30 s), on the
real stack: what compose's `restart: unless-stopped` and a Kubernetes container restart do.

The restarted process is registered at once (not refused as a "live twin" until the dead one's
lease lapses), the dead process's blocks leave the index at once (no router credits a prefix the
replica lost), and the router routes by what the new process holds. A second live process under
the same id is still refused and changes nothing.
"""

from __future__ import annotations

from engine_service.index.link import IndexLinkOptions
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.router.stack import (
    BLOCK_SIZE,
    engine_args,
    generate,
    generate_kv_routed,
    hasher_of,
    wait_until,
)
from tests.router.test_routing import PREFIX_BLOCKS, prompt, with_suffix

SHIPPED_LEASE_S = IndexLinkOptions().lease_s


def engine_stats(stack, target: str) -> pb.EngineStatsResponse:
    with stack.channel(target) as channel:
        return pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(), timeout=10)


def instance_of(stack, target: str) -> str:
    with stack.channel(target) as channel:
        return pb_grpc.GenerationStub(channel).ModelInfo(pb.ModelInfoRequest(),
                                                         timeout=10).instance_id


def link_state(stack, target: str) -> dict[str, str]:
    return dict(engine_stats(stack, target).index_details)


def test_the_stack_runs_at_the_shipped_lease():
    # Everything below means something only while a dead process's lease outlives the test's
    # waits: with a 2 s lease the lapse itself let the restart in.
    assert SHIPPED_LEASE_S >= 30


def test_an_engine_killed_and_restarted_under_its_id_is_registered_at_once(stack, router_stub):
    ids = prompt(61)
    chain = hasher_of(router_stub).chain(ids, None)
    _, [victim] = generate(router_stub, ids, max_tokens=2)
    wait_until(lambda: stack.lookup(chain).get(victim, 0) >= PREFIX_BLOCKS,
               what="the victim's copy of the prefix in the index")
    old = stack.engines[victim]
    old_instance, port = instance_of(stack, old.target), old.port
    old_epoch = int(link_state(stack, old.target)["epoch"])

    stack.kill_engine(victim)  # SIGKILL: no drain, no word to the index; ~30 s of lease left
    restarted = stack.start_engine(victim, port=port)
    assert instance_of(stack, restarted.target) != old_instance

    # Registered well inside the dead process's lease (before the takeover it was refused
    # until the lease lapsed, serving on its local LRU meanwhile).
    state = wait_until(lambda: (s := link_state(stack, restarted.target))["state"] == "ok" and s,
                       timeout_s=SHIPPED_LEASE_S / 2, what="the restarted engine registered")
    assert int(state["epoch"]) > old_epoch
    assert state["registrations"] == "1"  # in at the first try: never refused
    # The dead process's blocks left the index with its lease: nobody credits them now.
    assert victim not in stack.lookup(chain)

    # What the new process computes is the index's again, and the router routes by it.
    fresh = prompt(62)
    fresh_chain = hasher_of(router_stub).chain(fresh, None)
    with stack.channel(restarted.target) as channel:
        generate(pb_grpc.GenerationStub(channel), fresh, max_tokens=2)
    wait_until(lambda: stack.lookup(fresh_chain).get(victim, 0) >= PREFIX_BLOCKS,
               what="the restarted engine's commits in the index")
    reply, replicas, holders = generate_kv_routed(
        router_stub, with_suffix(fresh, 5, len(fresh_chain) * BLOCK_SIZE), {victim})
    assert len(replicas) == 1 and replicas[0] in holders, (replicas, holders)
    assert reply.usage.cached_tokens >= PREFIX_BLOCKS * BLOCK_SIZE


def test_a_live_twin_under_the_same_id_is_refused(stack, router_stub, tiny_llama_dir):
    holder_id = next(iter(stack.engines))
    holder = stack.engines[holder_id]
    wait_until(lambda: link_state(stack, holder.target)["state"] == "ok",
               what="the holder registered")
    epoch = link_state(stack, holder.target)["epoch"]
    # Another live process under the holder's id, at another address (not one of the stack's
    # replicas: stopped here).
    twin = EngineProcess(tiny_llama_dir, engine_args(stack.index.target, holder_id),
                         log_path=stack.log_dir / f"{holder_id}-twin.log",
                         tls=stack.certs.files("engine")).start()
    try:
        state = wait_until(
            lambda: (s := link_state(stack, twin.target))["state"] == "refused" and s,
            what="the twin refused")
        assert "held by another live process" in state["last_error"]
        assert f"instance {instance_of(stack, holder.target)} still answers" in state["last_error"]
        # The holder keeps its lease, its epoch and its place in the index.
        after = link_state(stack, holder.target)
        assert after["state"] == "ok" and after["epoch"] == epoch
    finally:
        twin.kill()
