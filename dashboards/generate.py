"""ftsystem's Grafana dashboards, built in code: ``python dashboards/generate.py [--out DIR]``.

Writes one JSON file per dashboard (default: next to this script), which Grafana's file provider
loads (``provisioning/dashboards/ftsystem.yaml``). The JSON is committed; edit this file, never
the JSON, and regenerate: a test fails while they differ.

Every panel, query, variable and annotation reads the Prometheus the ``datasource`` variable
selects (no datasource uid is written in the JSON: Grafana's default Prometheus unless one picks
another), and selects the job by the ``job`` label the controller's service discovery gives
each target; etcd panels select the job's etcd by its scrape job (the ``etcd_job`` variable).
Every process creates its labelled series at zero when it starts (``ftsystem.measure.metrics.init_*``),
so ``increase`` sees the first failure too. A counter is plotted only through ``rate`` or
``increase``, never raw: a restarted process starts its counters over. Panels stay readable at
thousands of replicas: per replica they show the ``TOPK`` worst (``topk``/``bottomk``), and
distributions over all replicas as heatmaps. Failures and epoch changes are annotations on every
time axis; the collapsed "GPU" row reads NVIDIA's DCGM exporter where Prometheus scrapes one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (AnnotationQuery, Dashboard, DashboardLink,
                                                       DatasourceVariable, QueryVariable, Row)
from grafana_foundation_sdk.builders.heatmap import Panel as Heatmap
from grafana_foundation_sdk.builders.heatmap import YAxisConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (BigValueGraphMode, LegendDisplayMode,
                                                  LegendPlacement)
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models.dashboard import (DashboardLinkType, DataSourceRef,
                                                     VariableOption, VariableRefresh, VariableSort)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
"""The Prometheus the ``datasource`` variable selects: any Grafana can import the dashboards,
whatever uid it gave its Prometheus (provisioning/datasources/prometheus.yaml gives ``prometheus``)."""
TAG = "ftsystem"
JOB = 'job="$job"'
REPLICA = 'job="$job", replica=~"$replica"'
ETCD = 'job="$etcd_job"'
"""The job's etcd, by the scrape job that reads it: not the cluster's own etcd (Kubernetes')."""
ETCD_JOB = "etcd"
"""The default of ``etcd_job``: the job_name of etcd in docker/prometheus.yml."""
GPU = 'Hostname=~"$gpu_host"'
"""The DCGM exporter's series of the hosts the ``gpu_host`` variable selects."""
OUT_DIR = Path(__file__).resolve().parent
TOPK = 10
"""Per-replica panels show this many replicas (the worst): thousands of lines are unreadable."""


# --- building blocks -------------------------------------------------------------------------

def query(expr: str, legend: str = "__auto") -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def timeseries(title: str, description: str, unit: str, *targets: Dataquery,
               width: int = 12) -> Timeseries:
    panel = (Timeseries().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .height(8).span(width)
             .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM).show_legend(True)))
    return _with_targets(panel, targets)


def stat(title: str, description: str, expr: str, unit: str = "none") -> Stat:
    panel = (Stat().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .height(4).span(6).graph_mode(BigValueGraphMode.AREA)
             .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    return _with_targets(panel, [query(expr)])


def heatmap(title: str, description: str, unit: str, metric: str, selector: str) -> Heatmap:
    """The distribution of a histogram over every replica, per time bucket."""
    panel = (Heatmap().title(title).description(description).datasource(DATASOURCE)
             .height(8).span(12).calculate(False).y_axis(YAxisConfig().unit(unit)))
    target = query(f"sum by (le) (rate({metric}_bucket{{{selector}}}[$__rate_interval]))",
                   "{{le}}").format(PromQueryFormat.HEATMAP)
    return _with_targets(panel, [target])


def worst(k_func: str, expr: str) -> str:
    """``topk``/``bottomk`` of ``TOPK`` series."""
    return f"{k_func}({TOPK}, {expr})"


def _with_targets(panel, targets):
    for ref, target in zip("ABCDEFGH", targets):
        panel.with_target(target.ref_id(ref))
    return panel


def quantiles(metric: str, selector: str, by: str, qs: tuple[float, ...]) -> list[Dataquery]:
    """Quantiles of a histogram observed every step, over ``$__rate_interval``: the ``TOPK``
    highest series of each."""
    return [query(worst("topk", f"histogram_quantile({q}, sum by (le, {by}) "
                                f"(rate({metric}_bucket{{{selector}}}[$__rate_interval])))"),
                  f"{{{{{by}}}}} p{round(q * 100)}") for q in qs]


def mean(metric: str, selector: str, by: str) -> Dataquery:
    """Exact mean of a histogram's observations since each process started."""
    return query(f"sum by ({by}) ({metric}_sum{{{selector}}}) / "
                 f"sum by ({by}) ({metric}_count{{{selector}}})", f"{{{{{by}}}}}")


def datasource_variable() -> DatasourceVariable:
    """The Prometheus every panel reads (default: Grafana's default Prometheus datasource)."""
    return DatasourceVariable("datasource").label("Datasource").type("prometheus")


def job_variable(metric: str = "ftsystem_epoch") -> QueryVariable:
    """The job, among those that export ``metric`` (HALoS jobs have no membership epoch)."""
    return (QueryVariable("job").label("Job").datasource(DATASOURCE)
            .query(f"label_values({metric}, job)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))


def replica_variable() -> QueryVariable:
    return (QueryVariable("replica").label("Replica").datasource(DATASOURCE)
            .query(f"label_values(ftsystem_steps_committed_total{{{JOB}}}, replica)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NATURAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def etcd_variable() -> QueryVariable:
    """The scrape job of the job's etcd, among those that export etcd's metrics."""
    return (QueryVariable("etcd_job").label("etcd scrape job").datasource(DATASOURCE)
            .description("The Prometheus job that scrapes this job's etcd (not the cluster's "
                         "own etcd).")
            .query("label_values(etcd_server_has_leader, job)")
            .current(VariableOption(selected=True, text=ETCD_JOB, value=ETCD_JOB))
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC))


def gpu_variable() -> QueryVariable:
    """The hosts whose GPUs the "GPU" row shows (DCGM's ``Hostname``; "All": every one)."""
    return (QueryVariable("gpu_host").label("GPU hosts").datasource(DATASOURCE)
            .description("Hosts of the DCGM exporter's series: pick the job's nodes.")
            .query("label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NATURAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text="All", value="$__all")))


class _PrometheusAnnotationQuery(models.AnnotationQuery):
    """The SDK's annotation query, with the Prometheus fields it lacks (title and tags)."""

    def __init__(self, title_format: str, tag_keys: str) -> None:
        super().__init__()
        self.title_format = title_format
        self.tag_keys = tag_keys

    def to_json(self) -> dict[str, object]:
        return super().to_json() | {"titleFormat": self.title_format, "tagKeys": self.tag_keys,
                                    "useValueForTime": False}


class PrometheusAnnotation(AnnotationQuery):
    """An annotation query on Prometheus, titled and tagged from the series' labels."""

    def __init__(self, title_format: str, tag_keys: str) -> None:
        super().__init__()
        self._internal = _PrometheusAnnotationQuery(title_format, tag_keys)


def annotation(name: str, color: str, expr: str, title: str, tag_keys: str) -> AnnotationQuery:
    """Events where ``expr`` (an ``increase`` over ``$__rate_interval`` of a counter, > 0) has
    a value, titled ``title`` (``{{label}}`` templates) and tagged with ``tag_keys``' values."""
    return (PrometheusAnnotation(title, tag_keys).name(name).datasource(DATASOURCE).enable(True)
            .hide(False).icon_color(color).expr(expr))


def restarts_annotation(name: str = "Replica restarts") -> AnnotationQuery:
    return annotation(name, "red", f"sum by (replica) (increase(ftsystem_replica_restarts_total"
                                   f"{{{JOB}}}[$__rate_interval])) > 0",
                      "{{replica}} restarted", "replica")


def chaos_annotation() -> AnnotationQuery:
    return annotation("Injected chaos", "orange",
                      f'sum by (action) (increase(ftsystem_failures_injected_total{{{JOB}, '
                      f'state="done"}}[$__rate_interval])) > 0', "chaos: {{action}}", "action")


def epoch_annotation() -> AnnotationQuery:
    return annotation("Epoch changes", "blue",
                      f"sum by (reason) (increase(ftsystem_membership_changes_total{{{JOB}}}"
                      f"[$__rate_interval])) > 0", "new epoch ({{reason}})", "reason")


def ft_hsdp_annotations() -> list[AnnotationQuery]:
    """Failures (restarts, chaos) and epoch changes of an FT-HSDP job."""
    return [restarts_annotation(), chaos_annotation(), epoch_annotation()]


def gpu_row() -> tuple[str, list, bool]:
    """A collapsed row of the DCGM exporter's GPU metrics (empty where none is scraped)."""
    return ("GPU", [
        timeseries("GPU utilization", f"Share of time the GPUs were busy (DCGM): the mean over "
                   f"the selected hosts' GPUs and the {TOPK} least busy.", "percent",
                   query(f"avg(DCGM_FI_DEV_GPU_UTIL{{{GPU}}})", "mean"),
                   query(worst("bottomk", f"DCGM_FI_DEV_GPU_UTIL{{{GPU}}}"),
                         "{{Hostname}} GPU {{gpu}}"), width=8),
        timeseries("GPU memory used", f"Frame buffer in use (DCGM): the {TOPK} fullest GPUs.",
                   "mbytes", query(worst("topk", f"DCGM_FI_DEV_FB_USED{{{GPU}}}"),
                                   "{{Hostname}} GPU {{gpu}}"), width=8),
        timeseries("GPU power", f"Power draw (DCGM): all selected GPUs together and the {TOPK} "
                   f"that draw most.", "watt",
                   query(f"sum(DCGM_FI_DEV_POWER_USAGE{{{GPU}}})", "total"),
                   query(worst("topk", f"DCGM_FI_DEV_POWER_USAGE{{{GPU}}}"),
                         "{{Hostname}} GPU {{gpu}}"), width=8),
    ], True)


def dashboard(uid: str, title: str, description: str, variables: list[QueryVariable], *,
              annotations: list[AnnotationQuery], sections: list[tuple]) -> Dashboard:
    """A dashboard of rows of panels, linked to the other ftsystem dashboards. A section is
    ``(title, panels)``, or ``(title, panels, True)`` for a row collapsed at load."""
    built = (Dashboard(title).uid(uid).description(description).tags([TAG])
             .time("now-30m", "now").refresh("10s").timezone("browser")
             .link(DashboardLink("ftsystem").type(DashboardLinkType.DASHBOARDS).tags([TAG])
                   .as_dropdown(True).include_vars(True).keep_time(True)))
    for variable in [datasource_variable(), *variables]:
        built.with_variable(variable)
    for query_ in annotations:
        built.annotation(query_)
    panel_id = 0
    for row_title, panels, *collapsed in sections:
        panel_id += 1
        row = Row(row_title).id(panel_id)
        if collapsed and collapsed[0]:
            for panel in panels:
                panel_id += 1
                row.with_panel(panel.id(panel_id))
            built.with_row(row)
            continue
        built.with_row(row)
        for panel in panels:
            panel_id += 1
            built.with_panel(panel.id(panel_id))
    return built


# --- the dashboards --------------------------------------------------------------------------

def job_overview() -> Dashboard:
    return dashboard("ftsystem-job", "ftsystem / Job overview",
                     "Membership, progress, failures and stalls of one job.",
                     [job_variable(), etcd_variable(), gpu_variable()],
                     annotations=ft_hsdp_annotations(), sections=[
        ("Membership", [
            stat("Epoch", "Current membership epoch number.", f"max(ftsystem_epoch{{{JOB}}})"),
            stat("Members", "Members of the current epoch.",
                 f"max(ftsystem_epoch_members{{{JOB}}})"),
            stat("Replica restarts", "Restarts by the agents in the dashboard's time range.",
                 f"sum(increase(ftsystem_replica_restarts_total{{{JOB}}}[$__range]))"),
            stat("Leading controllers", "Controllers that say they lead: 1 when healthy.",
                 f"sum(ftsystem_controller_is_leader{{{JOB}}})"),
            timeseries("Replicas by state", "Registered replicas by state, as the controllers "
                       "read them from etcd.", "none",
                       query(f"max by (state) (ftsystem_replicas{{{JOB}}})", "{{state}}")),
            timeseries("Membership changes by reason", "Epochs published in the last hour, by "
                       "reason (the leaders' counts together).", "none",
                       query(f"sum by (reason) (increase(ftsystem_membership_changes_total"
                             f"{{{JOB}}}[1h]))", "{{reason}}")),
        ]),
        ("Progress", [
            timeseries("ETTR", "Effective training time ratio since the leading controller "
                       "took over: time-based (share of time the job advances at its normal "
                       "pace) and work-based (steps committed over what all replicas could).",
                       "percentunit",
                       query(f"max by (kind) (ftsystem_ettr_ratio{{{JOB}}})", "{{kind}}")),
            timeseries("Steps per second", f"Committed steps per second: the job (its fastest "
                       f"replica) and the {TOPK} slowest replicas.", "none",
                       query(f"max(rate(ftsystem_steps_committed_total{{{JOB}}}"
                             f"[$__rate_interval]))", "job"),
                       query(worst("bottomk", f"max by (replica) "
                                              f"(rate(ftsystem_steps_committed_total{{{JOB}}}"
                                              f"[$__rate_interval]))"), "{{replica}}")),
            timeseries("Goodput", "Training samples committed per second by the whole job "
                       "(every rank trains on its own shard).", "none",
                       query(f"sum(rate(ftsystem_samples_total{{{JOB}}}[$__rate_interval]))",
                             "samples/s")),
            timeseries("Step lag per replica", f"Steps each replica is behind the job's most "
                       f"advanced one, from the progress they report to etcd (a few seconds "
                       f"late): the {TOPK} furthest behind.", "none",
                       query(worst("topk", f"max by (job) (ftsystem_replica_step{{{JOB}}}) - "
                                           f"on (job) group_right max by (job, replica) "
                                           f"(ftsystem_replica_step{{{JOB}}})"), "{{replica}}")),
            heatmap("Step duration, all replicas", "Wall time between commits over every "
                    "replica: where most steps fall, and the tail.", "s",
                    "ftsystem_step_duration_seconds", JOB),
            timeseries("Membership decision latency", "From a registration change seen by the "
                       "leader to its epoch published: quantiles over the decisions since the "
                       "leader started.", "s",
                       *[query(f"histogram_quantile({q}, sum by (le) "
                               f"(ftsystem_membership_decision_seconds_bucket{{{JOB}}}))",
                               f"p{round(q * 100)}") for q in (0.5, 0.99)]),
        ]),
        ("Failures and stalls", [
            timeseries("Failures per hour", "Replica restarts by the agents over the last "
                       "hour, and chaos orders carried out.", "none",
                       query(f"sum(increase(ftsystem_replica_restarts_total{{{JOB}}}[1h]))",
                             "restarts"),
                       query(f"sum(increase(ftsystem_failures_injected_total{{{JOB}, "
                             f'state="done"}}[1h]))', "injected"), width=8),
            timeseries("Replica restarts", f"Restarts in the last hour of the {TOPK} most "
                       f"restarted replicas by their agents.", "none",
                       query(worst("topk", f"sum by (replica) (increase("
                                           f"ftsystem_replica_restarts_total{{{JOB}}}[1h]))"),
                             "{{replica}}"), width=8),
            timeseries("Time stalled", f"Fraction of the time the {TOPK} most stalled replicas "
                       f"spend reconfiguring or waiting for an epoch.", "percentunit",
                       query(worst("topk", f"max by (replica) "
                                           f"(rate(ftsystem_stall_seconds_total{{{JOB}}}"
                                           f"[$__rate_interval]))"), "{{replica}}"), width=8),
            timeseries("Injected chaos", "Chaos orders the agents carried out in the last "
                       "hour, by action and outcome.", "none",
                       query(f"sum by (action, state) (increase("
                             f"ftsystem_failures_injected_total{{{JOB}}}[1h])) > 0 or "
                             f"sum(increase(ftsystem_failures_injected_total{{{JOB}}}[1h]))",
                             "{{action}} {{state}}"), width=8),
            timeseries("Epoch change time by reason", "Mean time of the members to enter a "
                       "new epoch (reconfigure and state sync), since each process started.",
                       "s", mean("ftsystem_epoch_change_seconds", JOB, "reason"), width=8),
        ]),
        ("etcd", [
            stat("etcd has a leader", "1 when every member of the job's etcd (scrape job "
                 "$etcd_job) sees a leader; 0: etcd refuses writes and the job cannot change "
                 "membership.", f"min(etcd_server_has_leader{{{ETCD}}})"),
            timeseries("etcd database vs quota", "Database size over the backend quota of "
                       "each member: at 100% etcd refuses every write (alert at 80%).",
                       "percentunit",
                       query(f"max by (instance) (etcd_mvcc_db_total_size_in_bytes{{{ETCD}}}) "
                             f"/ max by (instance) (etcd_server_quota_backend_bytes{{{ETCD}}})",
                             "{{instance}}"), width=9),
            timeseries("etcd WAL fsync p99", "The disk latency etcd waits for on every write.",
                       "s", query(f"histogram_quantile(0.99, sum by (le, instance) "
                                  f"(rate(etcd_disk_wal_fsync_duration_seconds_bucket{{{ETCD}}}"
                                  f"[$__rate_interval])))", "{{instance}}"), width=9),
        ]),
        gpu_row(),
    ])


def replica_detail() -> Dashboard:
    return dashboard("ftsystem-replica", "ftsystem / Replica detail",
                     "Steps, all-reduce and training signals of each replica.",
                     [job_variable(), replica_variable()], annotations=ft_hsdp_annotations(),
                     sections=[
        ("Step and all-reduce", [
            timeseries("Step duration", "Wall time between commits.", "s",
                       *quantiles("ftsystem_step_duration_seconds", REPLICA, "replica",
                                  (0.5, 0.9, 0.99)), width=8),
            timeseries("FTAR duration", "Time of the successful fault-tolerant all-reduce.",
                       "s", *quantiles("ftsystem_ftar_duration_seconds", REPLICA, "replica",
                                       (0.5, 0.99)), width=8),
            timeseries("FTAR failures", f"All-reduce attempts that failed in the last hour "
                       f"({TOPK} replicas with the most).", "none",
                       query(worst("topk", f"max by (replica) (increase("
                                           f"ftsystem_ftar_failures_total{{{REPLICA}}}[1h]))"),
                             "{{replica}}"), width=8),
        ]),
        ("Training", [
            timeseries("Training loss", f"Last loss each replica committed, as its rank 0 "
                       f"passed it ({TOPK} highest).",
                       "none", query(worst("topk", f"max by (replica) "
                                                   f"(ftsystem_training_loss{{{REPLICA}}})"),
                                     "{{replica}}")),
            timeseries("Samples per second", f"Training samples committed per second ({TOPK} "
                       f"slowest replicas).", "none",
                       query(worst("bottomk", f"sum by (replica) "
                                              f"(rate(ftsystem_samples_total{{{REPLICA}}}"
                                              f"[$__rate_interval]))"), "{{replica}}")),
        ]),
    ])


def catch_up() -> Dashboard:
    return dashboard("ftsystem-catchup", "ftsystem / Catch-up",
                     "How restarted replicas catch up with the job and rejoin it. A joiner "
                     "process catches up once: its values are those of its catch-up.",
                     [job_variable()], annotations=ft_hsdp_annotations(), sections=[
        ("Catch-up", [
            timeseries("Catch-up in progress", "Replicas catching up now, as the controllers "
                       "read them from etcd (alert: one for over 15 minutes).", "none",
                       query(f'max(ftsystem_replicas{{{JOB}, state="catching_up"}})',
                             "catching up")),
            timeseries("Catch-up duration", "From a joiner's start of catch-up to ready.",
                       "s", mean("ftsystem_catchup_duration_seconds", JOB, "replica")),
            timeseries("Bytes fetched", "Bytes each joiner fetched from donors (snapshot and "
                       "update log) in the last hour.", "bytes",
                       query(f"sum by (replica) (increase(ftsystem_catchup_bytes_total{{{JOB}}}"
                             f"[1h]))", "{{replica}}")),
            timeseries("Updates replayed", "Logged updates each replica replayed in the last "
                       "hour, in catch-up and in reconciliation at an epoch change.", "none",
                       query(f"sum by (replica) (increase("
                             f"ftsystem_catchup_steps_replayed_total{{{JOB}}}[1h]))",
                             "{{replica}}")),
            timeseries("Join epoch change time", "Mean time of each member to enter an epoch "
                       "published for a joiner (reconfigure and state sync).", "s",
                       mean("ftsystem_epoch_change_seconds", f'{JOB}, reason="join"',
                            "replica")),
        ]),
    ])


def halos() -> Dashboard:
    lps = f'{JOB}, server=~"lps.*"'
    return dashboard("ftsystem-halos", "ftsystem / HALoS",
                     "A HALoS run in real mode (ftsystem halos run): the global model, the local "
                     "parameter servers and their exchanges with the GPS, the workers.",
                     [job_variable("ftsystem_halos_global_updates"), gpu_variable()],
                     annotations=[restarts_annotation("Node restarts")], sections=[
        ("Global model", [
            stat("Global updates", "LPS deltas the GPS has applied.",
                 f"max(ftsystem_halos_global_updates{{{JOB}}})"),
            stat("Held-out loss", "Held-out loss of the global model after its last update.",
                 f"min(ftsystem_halos_global_loss{{{JOB}}})"),
            stat("Merges", "Global models the LPSs merged in the dashboard's time range.",
                 f"sum(increase(ftsystem_halos_merges_total{{{JOB}}}[$__range]))"),
            stat("Node restarts", "Restarts of the GPS, LPSs and workers by their agents in the "
                 "dashboard's time range.",
                 f"sum(increase(ftsystem_replica_restarts_total{{{JOB}}}[$__range]))"),
            timeseries("Held-out loss of the global model", "Evaluated by the GPS after every "
                       "global update.", "none",
                       query(f"min(ftsystem_halos_global_loss{{{JOB}}})", "global model")),
            timeseries("Global updates per minute", "LPS deltas applied by the GPS.", "none",
                       query(f'sum(rate(ftsystem_halos_updates_applied_total{{{JOB}, '
                             f'server="gps"}}[$__rate_interval])) * 60', "updates/min")),
        ]),
        ("Local parameter servers", [
            timeseries("Worker updates applied per second", "Pseudo-gradients each LPS "
                       "applied (local momentum).", "none",
                       query(f"sum by (server) (rate(ftsystem_halos_updates_applied_total"
                             f"{{{lps}}}[$__rate_interval]))", "{{server}}"), width=8),
            timeseries("Exchange with the GPS", "Mean round trip of an LPS's delta to the GPS "
                       "and the global model back (the slow, inter-region link), since each "
                       "LPS started.", "s",
                       mean("ftsystem_halos_exchange_seconds", JOB, "server"), width=8),
            timeseries("Staleness", "LPS updates between the model a worker started from and "
                       "the one its pseudo-gradient was applied to: quantiles over each LPS's "
                       "pushes since it started.", "none",
                       *[query(f"histogram_quantile({q}, sum by (le, server) "
                               f"(ftsystem_halos_staleness_updates_bucket{{{JOB}}}))",
                               f"{{{{server}}}} p{round(q * 100)}") for q in (0.5, 0.9)],
                       width=8),
        ]),
        ("Workers", [
            timeseries("Worker loss", f"Mean training loss of each worker's last job ({TOPK} "
                       f"highest).", "none",
                       query(worst("topk", f"max by (worker) "
                                           f"(ftsystem_halos_worker_loss{{{JOB}}})"),
                             "{{worker}}"), width=8),
            timeseries("Pushes per second", f"Pseudo-gradients acknowledged by the LPS, per "
                       f"worker ({TOPK} slowest): faster workers push more often unless H is "
                       f"rescaled.", "none",
                       query(worst("bottomk", f"sum by (worker) "
                                              f"(rate(ftsystem_halos_worker_pushes_total"
                                              f"{{{JOB}}}[$__rate_interval]))"), "{{worker}}"),
                       width=8),
            timeseries("Traffic", f"Tensor bytes per second each node sent and received "
                       f"({TOPK} busiest).", "Bps",
                       query(worst("topk", f"sum by (node, direction) "
                                           f"(rate(ftsystem_halos_bytes_total{{{JOB}}}"
                                           f"[$__rate_interval]))"),
                             "{{node}} {{direction}}"), width=8),
            timeseries("Node restarts", f"Restarts in the last hour of the {TOPK} most "
                       f"restarted nodes by their agents.", "none",
                       query(worst("topk", f"sum by (replica) (increase("
                                           f"ftsystem_replica_restarts_total{{{JOB}}}[1h]))"),
                             "{{replica}}")),
        ]),
        gpu_row(),
    ])


DASHBOARDS = {"job-overview": job_overview, "replica-detail": replica_detail,
              "catch-up": catch_up, "halos": halos}
"""File name (without ``.json``) to builder."""


def render(built: Dashboard) -> str:
    return json.dumps(built.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in DASHBOARDS.items():
        path = out_dir / f"{name}.json"
        path.write_text(render(build()))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR,
                        help="directory for the JSON files (default: %(default)s)")
    for path in write_all(parser.parse_args(argv).out):
        print(path)


if __name__ == "__main__":
    main()
