"""Engine test fixtures: every LLM built here is checked after each test for a fully free pool
and no negative refcount (checked, not assumed)."""

import pytest

from engine_service import LLM


@pytest.fixture(scope="session")
def live_llms() -> list[LLM]:
    return []


@pytest.fixture
def make_llm(live_llms: list[LLM]):
    """Build an LLM for one test; its pool is checked when the test ends."""
    created: list[LLM] = []

    def factory(model, **engine_args) -> LLM:
        # float32 unless a test asks otherwise: these tests compare tokens with HF float32 (or
        # across batch shapes), which is exact only in float32; "auto" may pick bfloat16.
        engine_args.setdefault("dtype", "float32")
        llm = LLM(model=str(model), **engine_args)
        created.append(llm)
        return llm

    yield factory
    for llm in created:
        assert llm.llm_engine.check_block_invariants() == []


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir, live_llms: list[LLM]) -> LLM:
    llm = LLM(model=str(smollm2_dir), block_size=16, num_blocks=1024, dtype="float32")
    live_llms.append(llm)
    yield llm
    live_llms.remove(llm)


@pytest.fixture(autouse=True)
def _shared_pools_free_after_each_test(live_llms: list[LLM]):
    yield
    for llm in live_llms:
        assert not llm.llm_engine.has_unfinished_requests()
        assert llm.llm_engine.check_block_invariants() == []
