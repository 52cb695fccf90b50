"""Prometheus exposition of a run's figures, so a Grafana that scrapes ``/metrics`` shows the same
numbers as the dashboard.  A collector computes them from the run store at scrape time: nothing is
kept in memory between scrapes, and a finished run is served as well as a live one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orchestrator.runs.figures import cost_breakdown, headline, round_rows
from orchestrator.runs.store import RunStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RunCollector(Collector):
    """Every figure of one run, labelled with the run's name."""

    def __init__(self, store: RunStore, now: Callable[[], float], live: Callable[[], bool]) -> None:
        self.store, self.now, self.live = store, now, live

    def collect(self) -> Iterator[Metric]:
        now, live = self.now(), self.live()
        h = headline(self.store, now, live)
        run = {"run": h.cluster}

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=list(run))
                family.add_metric(list(run.values()), value)
                yield family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=list(run))
            family.add_metric(list(run.values()), value)
            return family

        yield from gauge("spotswarm_run_live", "1 while the run is up, 0 once it stopped", float(live))
        yield from gauge("spotswarm_epoch", "global training epoch", h.epoch)
        yield from gauge("spotswarm_loss", "mean loss reported by the peers", h.loss)
        yield from gauge("spotswarm_samples_per_second", "global training throughput", h.samples_per_second)
        yield counter("spotswarm_samples", "samples trained (at the newest epoch)", h.samples)
        yield counter("spotswarm_preemptions", "instances the cloud took away after a notice", h.preemptions)
        yield counter("spotswarm_replacements", "instances launched to replace a lost one", h.replacements)
        yield counter("spotswarm_instances_launched", "instances the run ever had", h.instances)
        yield from gauge("spotswarm_dollars_per_million_samples", "dollars spent per million samples trained",
                         h.dollars_per_million_samples)
        yield from gauge("spotswarm_savings_dollars", "on-demand counterfactual minus dollars spent",
                         h.savings_dollars)
        yield from gauge("spotswarm_dollars_per_hour", "hourly price of the instances up now", h.dollars_per_hour)
        yield from gauge("spotswarm_experts_live", "experts of the grid with a live server (MoE runs)", h.experts_live)
        yield from gauge("spotswarm_experts_min_replicas", "servers holding the least-held expert (MoE runs)",
                         h.experts_min_replicas)
        yield from gauge("spotswarm_kmin_fraction", "forward passes whose every row got k_min answers (MoE runs)",
                         h.kmin_fraction)
        last_round = round_rows(self.store, recent=1)
        if last_round:
            r = last_round[0]
            yield from gauge("spotswarm_round_epoch", "the newest epoch a trainer reported its time split of",
                             r.epoch)
            yield from gauge("spotswarm_round_compute_seconds",
                             "that epoch's seconds of compute, the mean over the trainers that reported it",
                             r.compute_s)
            yield from gauge("spotswarm_round_comm_seconds",
                             "that epoch's seconds averaging or downloading state, the mean over the same trainers",
                             r.comm_s)

        labels = [*run, "node_type", "zone", "market"]
        live_instances = GaugeMetricFamily("spotswarm_live_instances", "instances up now", labels=labels)
        dollars = CounterMetricFamily("spotswarm_cost_dollars", "dollars spent: instance-seconds x price",
                                      labels=labels)
        on_demand = CounterMetricFamily("spotswarm_on_demand_cost_dollars",
                                        "the same instance-seconds at on-demand prices", labels=labels)
        seconds = CounterMetricFamily("spotswarm_instance_seconds", "instance-seconds used", labels=labels)
        up = {}
        instances = self.store.instances()
        if live:
            for i in instances:
                if i.ended_at is None:
                    key = (i.node_type, i.zone, i.market)
                    up[key] = up.get(key, 0) + 1
        for g in cost_breakdown(instances, now):
            values = [h.cluster, g.node_type, g.zone, g.market]
            live_instances.add_metric(values, up.get((g.node_type, g.zone, g.market), 0))
            dollars.add_metric(values, g.dollars)
            on_demand.add_metric(values, g.on_demand_dollars)
            seconds.add_metric(values, g.instance_hours * 3600)
        yield from (live_instances, dollars, on_demand, seconds)


def render(store: RunStore, now: Callable[[], float], live: Callable[[], bool]) -> bytes:
    """The text exposition format, rendered from a registry of its own (never the global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(store, now, live))
    return generate_latest(registry)
