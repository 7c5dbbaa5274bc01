"""The three services' Prometheus metrics as an on-call person reads them: Prometheus naming,
buckets that fit what they measure, docs/operating.md listing exactly what is exported, and the
engine's running totals turned into counters once each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from engine_service.core.stats import EngineStats
from engine_service.serving.metrics import EngineMetrics
from pagedgen_api import generation_pb2 as pb
from prefix_index.server.metrics import IndexMetrics
from router.metrics import RouterMetrics

OPERATING_MD = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
# Label values that grow without bound (one series per request, tenant or message).
UNBOUNDED_LABELS = {"request_id", "tenant", "api_key", "key", "error", "message", "reason",
                    "prompt", "address", "peer", "engine_id"}
SERVICES = {  # the docs' section title -> the service's metrics
    "Engine": (EngineMetrics, "pagedgen_engine_"),
    "Router": (RouterMetrics, "pagedgen_router_"),
    "Prefix index": (IndexMetrics, "pagedgen_prefix_index_"),
}


def families(metrics) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exported name (counters with their `_total`) -> (type, label names)."""
    found = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            [family] = value.describe()
            name = family.name + ("_total" if family.type == "counter" else "")
            found[name] = (family.type, tuple(value._labelnames))
    return found


def documented(section: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The metric table under docs/operating.md's `### {section}: ...` heading."""
    text = OPERATING_MD.read_text()
    match = re.search(rf"^### {re.escape(section)}: .*?$(.*?)(?=^#{{2,4}} )", text,
                      flags=re.M | re.S)
    assert match, f"docs/operating.md has no '### {section}:' section"
    rows = re.findall(r"^\| (`[a-z0-9_]+`(?:, `[a-z0-9_]+`)*) \| (\w+) \|([^|]*)\|",
                      match.group(1), flags=re.M)
    listed = {}
    for names, kind, labels in rows:
        label_names = tuple(re.findall(r"`(\w+)`", labels))
        for name in re.findall(r"`([a-z0-9_]+)`", names):
            listed[name] = (kind, label_names)
    return listed


@pytest.mark.parametrize("section", SERVICES)
def test_docs_list_exactly_what_is_exported(section):
    make, prefix = SERVICES[section]
    exported = {name.removeprefix(prefix): kind for name, kind in families(make()).items()}
    listed = documented(section)
    assert sorted(set(exported) - set(listed)) == [], "exported but not in docs/operating.md"
    assert sorted(set(listed) - set(exported)) == [], "in docs/operating.md but not exported"
    for name, (kind, labels) in exported.items():
        assert listed[name] == (kind, labels), name


@pytest.mark.parametrize("make", [EngineMetrics, RouterMetrics, IndexMetrics])
def test_names_units_and_labels_follow_prometheus_conventions(make):
    for name, (kind, labels) in families(make()).items():
        assert re.fullmatch(r"pagedgen_(engine|router|prefix_index)_[a-z0-9_]+", name), name
        if kind == "counter":
            assert name.endswith("_total") and not name.endswith("_total_total"), name
        if kind == "histogram":  # every histogram of ours is a time: in the base unit
            assert name.endswith("_seconds"), name
        assert not re.search(r"_(ms|milliseconds|us|percent|kb|mb|mib)(_|$)", name), name
        assert not set(labels) & UNBOUNDED_LABELS, (name, labels)


def buckets(histogram) -> list[float]:
    return list(histogram._upper_bounds[:-1])  # without +Inf


def test_latency_buckets_fit_what_they_measure():
    metrics = EngineMetrics()
    # A request queued behind a long CPU prefill waits minutes for its first token.
    assert buckets(metrics.time_to_first_token)[-1] >= 300
    # A whole request of thousands of tokens on a CPU: up to an hour, not +Inf past a minute.
    assert buckets(metrics.e2e_request_latency)[-1] >= 3600
    # A decode step lands between 5 and 50 ms on a GPU: that is where an objective lies, so the
    # gaps between tokens need buckets there, not at 10, 30 and 60 s.
    gaps = buckets(metrics.time_per_output_token)
    assert len([b for b in gaps if 0.005 <= b <= 0.05]) >= 8, gaps
    assert gaps[-1] <= 5, gaps


def stats(**changed) -> EngineStats:
    base = dict(num_blocks=64, num_free_blocks=64, num_cached_blocks=0, kv_cache_usage=0.0,
                num_running=0, num_waiting=0, num_swapped=0, prefix_cache_queries=0,
                prefix_cache_hits=0, num_preemptions=0, num_steps=0)
    return EngineStats(**{**base, **changed})


def sample(metrics: EngineMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, f"{name} not exported"
    return value


def test_engine_totals_become_counters_and_the_queue_in_tokens_a_gauge():
    """What the engine core reports each step (its running totals since start) reaches the
    front as counter increments, once each, and its pool and queue as gauges."""
    metrics = EngineMetrics(CollectorRegistry())
    metrics.record(stats(num_steps=5, num_pins_released=2, num_cached_blocks=10,
                         num_pinned_in_budget=4, num_pinned_blocks=3,
                         num_waiting_prefill_tokens=700, num_waiting=3))
    metrics.record(stats(num_steps=5, num_pins_released=2, num_cached_blocks=12,
                         num_pinned_in_budget=4, num_pinned_blocks=3,
                         num_waiting_prefill_tokens=700, num_waiting=3))  # a repeated step
    metrics.record(stats(num_steps=9, num_pins_released=3, num_cached_blocks=12,
                         num_pinned_in_budget=5, num_waiting_prefill_tokens=0))
    assert sample(metrics, "pagedgen_engine_steps_total") == 9
    assert sample(metrics, "pagedgen_engine_pins_released_blocks_total") == 3
    assert sample(metrics, "pagedgen_engine_kv_cached_blocks") == 12
    assert sample(metrics, "pagedgen_engine_pinned_blocks") == 5  # idle and in use
    assert sample(metrics, "pagedgen_engine_waiting_prefill_tokens") == 0
    assert sample(metrics, "pagedgen_engine_num_requests_waiting") == 0
    assert b"pagedgen_engine_steps_total 9.0" in generate_latest(metrics.registry)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, flags=re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_a_served_request_shows_in_the_engine_s_steps_and_cache(engine_server, stub):
    """Through the real server (front and core in two processes): the core's steps and cached
    blocks reach the front's /metrics, and an idle engine has no prefill queued."""
    before = engine_server.metrics_text()
    steps_before = metric(before, "pagedgen_engine_steps_total")
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 to cache
    reply = stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    assert reply.usage.completion_tokens == 4
    text = engine_server.metrics_text()
    # A prefill step and three decode steps at least (more when other tests' requests ran).
    assert metric(text, "pagedgen_engine_steps_total") >= steps_before + 4
    assert metric(text, "pagedgen_engine_kv_cached_blocks") >= 2
    assert metric(text, "pagedgen_engine_waiting_prefill_tokens") == 0
    assert metric(text, "pagedgen_engine_pinned_blocks") >= 0
    assert metric(text, "pagedgen_engine_pins_released_blocks_total") >= 0
    for name in families(EngineMetrics()):  # every family the docs list, on the live server
        assert f"# TYPE {name} " in text, name


def help_text(metrics, name: str) -> str:
    [family] = getattr(metrics, name).describe()
    return family.documentation


def test_help_says_what_is_counted_where_it_is_not_what_the_name_suggests():
    """Read on a dashboard, the HELP line must not promise requests where sequences or attempts
    are counted."""
    engine, router, index = EngineMetrics(), RouterMetrics(), IndexMetrics()
    assert "n > 1 counts n" in help_text(engine, "requests_finished")
    assert "n > 1 counts n" in help_text(engine, "num_running")
    assert "idle pinned blocks are not free" in help_text(engine, "num_free_blocks")
    assert "retry" in help_text(router, "decisions")
    assert "call" in help_text(index, "redis_up")  # failing calls set it to 0 too, not probes only


def test_the_front_door_error_ratio_divides_by_every_request():
    """The alert's denominator counts every request (requests_total), not only those routed
    (route_seconds_count, which left out requests refused before routing)."""
    [row] = [line for line in OPERATING_MD.read_text().splitlines()
             if line.startswith("| errors at the front door |")]
    assert "pagedgen_router_requests_total" in row and "route_seconds_count" not in row
    assert "OK" in help_text(RouterMetrics(), "requests")
