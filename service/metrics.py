"""Prometheus metrics of one service process (its own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily


class StatusCounters:
    """Counters whose totals live in the service's state (the worker's, the database's) and are
    read from /status at scrape time: exposed as counters (`_total`), not gauges."""

    HELP = {
        "aser_samples_quarantined": "Samples set aside because training on them fails",
        "aser_snapshot_failures": "Snapshot exports that failed",
    }

    def __init__(self):
        self.values = dict.fromkeys(self.HELP, 0.0)

    def collect(self):
        for name, text in self.HELP.items():
            yield CounterMetricFamily(name, text, value=self.values[name])


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # the standard process_* metrics: resident memory, CPU seconds, open fds
        self.samples_received = Counter("aser_samples_received", "Samples newly stored in the ingest log",
                                        registry=r)
        self.requests_rejected = Counter("aser_requests_rejected", "Requests or messages refused with a 4xx",
                                         ["error"], registry=r)
        self.samples_trained = Counter("aser_samples_trained", "Samples the learner has trained on", registry=r)
        self.samples_replayed = Counter("aser_samples_replayed", "Memory samples replayed in training steps",
                                        registry=r)
        self.replayed_incoming = Counter("aser_samples_replayed_incoming_class", "Replayed samples of a class "
                                         "present in their step's incoming batch (under ASER_LOSS=ace the only "
                                         "place new classes meet old ones)", registry=r)
        self.train_step = Histogram("aser_train_step_seconds", "Duration of one learner step",
                                    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2), registry=r)
        self.predict_latency = Histogram("aser_predict_seconds", "Latency of predictions (decode + model)",
                                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0), registry=r)
        self.predict_batch = Histogram("aser_predict_batch_images", "Images per shared prediction forward pass",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024), registry=r)
        self.worker_restarts = Counter("aser_worker_restarts", "Restarts of the learner from the last checkpoint "
                                       "after a failed step", registry=r)
        self.damaged_files = Counter("aser_damaged_files", "Derived files (latent store, checkpoint, snapshot) found "
                                     "damaged when opened, set aside and rebuilt", ["kind"], registry=r)
        self.checkpoint_failures = Counter("aser_checkpoint_failures", "Checkpoints that could not be written",
                                           registry=r)
        self.backlog = Gauge("aser_backlog_samples", "Acknowledged samples not yet trained on", registry=r)
        self.model_version = Gauge("aser_model_version", "Version of the weights predictions use", registry=r)
        self.status_counters = StatusCounters()
        r.register(self.status_counters)
        self.online_accuracy = Gauge("aser_online_accuracy", "Test-then-train accuracy on every sample scored",
                                     registry=r)
        self.online_window_accuracy = Gauge("aser_online_window_accuracy", "Test-then-train accuracy over the last "
                                            "ASER_ONLINE_WINDOW samples", registry=r)
        self.online_class_accuracy = Gauge("aser_online_class_accuracy", "Test-then-train accuracy per class",
                                           ["class_label"], registry=r)
        self.online_unknown = Gauge("aser_online_unknown_samples", "Samples called \"none of these\" before their "
                                    "step: of a known class (false alarms) and of a class not yet learned (finds)",
                                    ["kind"], registry=r)
        self.new_class_samples = Gauge("aser_online_new_class_samples", "Samples of a class the model had not "
                                       "learned yet when they arrived", registry=r)
        self.worker_up = Gauge("aser_worker_up", "1 while the learner worker runs", registry=r)
        self.lag = Gauge("aser_lag_seconds", "Age of the oldest acknowledged sample the published model has not "
                         "learned (0: none waiting)", registry=r)
        self.samples_skipped = Counter("aser_samples_skipped", "Samples skipped without a gradient step, the worker "
                                       "being over ASER_MAX_LAG_S (this process)", registry=r)
        self.samples_thinned = Counter("aser_samples_thinned", "Skipped samples that did not reach the memory update "
                                       "either, its share of the worker's time being spent (this process)", registry=r)
        self.lean_steps = Counter("aser_lean_steps", "Stream steps taken in the method's cheapest form, the worker "
                                  "being behind by half of ASER_MAX_LAG_S (ASER_LEAN_WHEN_BEHIND; this process)",
                                  registry=r)
        self.rehearsal_steps = Counter("aser_rehearsal_steps", "Replay-only steps taken while the stream was idle "
                                       "(this process)", registry=r)
        self.sleeping = Gauge("aser_sleeping", "1 while the learner sleeps (ASER_SLEEP: the top trains over the "
                              "latent store)", registry=r)
        self.sleeps = Counter("aser_sleeps", "Sleeps ended, by kind (warm: the top as the last left it; fresh: "
                              "trained again from ImageNet's weights, asked for or a night's) and outcome: kept (the "
                              "served answer on the held-back samples no worse), rolled_back, or yielded (to "
                              "arriving samples, its rest owed)", ["kind", "outcome"], registry=r)
        self.sleep_updates = Counter("aser_sleep_sample_updates", "Sample-updates sleeps took (this process)",
                                     registry=r)
        self.sleep_cpu = Counter("aser_sleep_cpu_seconds", "CPU seconds sleeps took (this process)", registry=r)
        self.sleep_store_samples = Gauge("aser_sleep_store_samples", "Samples the sleep's latent store holds",
                                         registry=r)
        self.sleep_new_since_fresh = Gauge("aser_sleep_new_since_fresh", "Samples arrived since the last fresh "
                                           "sleep began (a night's sleep waits for ASER_SLEEP_MIN_NEW)", registry=r)
        self.database_bytes = Gauge("aser_database_bytes", "The SQLite database's size on disk, WAL included",
                                    registry=r)
        self.database_over_cap = Gauge("aser_database_over_cap", "1 while the database stays above "
                                       "ASER_RETAIN_MAX_MB with nothing trained left to drop", registry=r)
        self.retention_pixels = Counter("aser_retention_pixels_dropped", "Trained samples whose pixels retention "
                                        "dropped", registry=r)
        self.retention_ids = Counter("aser_retention_ids_dropped", "Rows (sample ids) retention deleted past the "
                                     "exactly-once horizon", registry=r)
        self.retention_freed = Counter("aser_retention_freed_bytes", "Bytes retention gave back to the file system",
                                       registry=r)

    def observe_step(self, seconds: float, samples: int, lean: bool, stats: dict) -> None:
        """One training step: its duration, its samples, and what it replayed (`observe`'s statistics)."""
        self.train_step.observe(seconds)
        self.samples_trained.inc(samples)
        self.lean_steps.inc(lean)
        self.samples_replayed.inc(stats.get("replayed", 0))
        self.replayed_incoming.inc(float(stats.get("replayed_incoming", 0)))

    def observe_skip(self, samples: int, thinned: int) -> None:
        """Samples skipped over the lag bound (`service.learning.lag_bound`), of which
        `thinned` skipped the memory too."""
        self.samples_skipped.inc(samples)
        self.samples_thinned.inc(thinned)

    def observe_sleep(self, report) -> None:
        """One sleep ended (`learner.methods.sleep.SleepReport`)."""
        outcome = "yielded" if report.yielded else "kept" if report.kept else "rolled_back"
        self.sleeps.labels(kind="fresh" if report.fresh else "warm", outcome=outcome).inc()
        self.sleep_updates.inc(report.updates)
        self.sleep_cpu.inc(report.cpu_seconds)

    def observe_retention(self, run: dict) -> None:
        self.retention_pixels.inc(run["pixels_dropped"])
        self.retention_ids.inc(run["ids_dropped"])
        self.retention_freed.inc(run["freed_bytes"])

    def observe_status(self, status: dict) -> None:
        """Set the gauges from a /status answer (read at scrape time)."""
        self.backlog.set(status["backlog"])
        self.model_version.set(status["model_version"])
        self.status_counters.values.update(aser_samples_quarantined=status["worker"]["quarantined"],
                                           aser_snapshot_failures=status["worker"]["snapshot_failures"])
        self.worker_up.set(1 if status["worker"]["alive"] else 0)
        self.database_bytes.set(status["storage"]["database_bytes"])
        self.database_over_cap.set(1 if status["storage"]["over_cap"] else 0)
        self.lag.set(status["lag"]["seconds"])
        if sleep := status.get("sleep"):
            self.sleeping.set(1 if sleep["state"] == "sleeping" else 0)
            self.sleep_store_samples.set(sleep["store"]["samples"])
            self.sleep_new_since_fresh.set(sleep["new_since_fresh"])
        online = status["online"]
        self.online_accuracy.set(online["accuracy"] if online["accuracy"] is not None else float("nan"))
        self.online_window_accuracy.set(online["window_accuracy"] if online["window_accuracy"] is not None
                                        else float("nan"))
        self.new_class_samples.set(online["new_class_samples"])
        for kind, n in online["unknown"].items():
            self.online_unknown.labels(kind=kind.removesuffix("_samples")).set(n)
        self.online_class_accuracy.clear()  # a forgotten class leaves the exposition
        for label, figures in online["per_class"].items():
            self.online_class_accuracy.labels(class_label=label).set(figures["accuracy"])
