"""NamedLocks, which keeps two PinPrefix calls of one prefix from interleaving (a failed call's
undo would otherwise drop the pin the other made): calls of one name run one at a time in
arrival order, other names do not wait, a waiter that is cancelled leaves the lock usable, and
no lock outlives its last user."""

from __future__ import annotations

import asyncio

from engine_service.serving.named_locks import NamedLocks


def test_one_name_runs_one_at_a_time_others_do_not_wait():
    async def scenario() -> list[str]:
        locks = NamedLocks()
        events: list[str] = []
        release_first = asyncio.Event()

        async def call(tag: str, name: str, wait: asyncio.Event | None = None) -> None:
            async with locks.hold(name):
                events.append(f"{tag} in")
                if wait is not None:
                    await wait.wait()
                events.append(f"{tag} out")

        first = asyncio.create_task(call("a1", "a", release_first))
        await asyncio.sleep(0)
        second = asyncio.create_task(call("a2", "a"))
        other = asyncio.create_task(call("b", "b"))
        await other  # another name is not held up by a1
        await asyncio.sleep(0.01)
        assert "a2 in" not in events  # the same name waits for a1
        release_first.set()
        await asyncio.gather(first, second)
        assert len(locks) == 0  # nothing kept once every user has left
        return events

    events = asyncio.run(scenario())
    assert events.index("a1 out") < events.index("a2 in")
    assert events.index("b out") < events.index("a1 out")


def test_a_cancelled_waiter_leaves_the_lock_usable():
    async def scenario() -> None:
        locks = NamedLocks()
        release = asyncio.Event()

        async def hold_until_released() -> None:
            async with locks.hold("x"):
                await release.wait()

        async def enter() -> None:
            async with locks.hold("x"):
                pass

        holder = asyncio.create_task(hold_until_released())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(enter())
        await asyncio.sleep(0.01)
        waiter.cancel()  # a client that gave up while waiting
        await asyncio.gather(waiter, return_exceptions=True)
        release.set()
        await holder
        await asyncio.wait_for(enter(), 5)  # not stuck behind the cancelled waiter
        assert len(locks) == 0

    asyncio.run(scenario())
