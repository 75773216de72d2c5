"""Prometheus metrics of one service process (its own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.samples_received = Counter("aser_samples_received", "Samples acknowledged (committed to the ingest log)",
                                        registry=self.registry)
        self.samples_rejected = Counter("aser_requests_rejected", "Requests refused with a 4xx", ["error"],
                                        registry=self.registry)
        self.samples_trained = Counter("aser_samples_trained", "Samples the learner has trained on",
                                       registry=self.registry)
        self.train_step = Histogram("aser_train_step_seconds", "Duration of one learner step",
                                    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2), registry=self.registry)
        self.predict_latency = Histogram("aser_predict_seconds", "Latency of predictions (decode + model)",
                                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
                                         registry=self.registry)
        self.backlog = Gauge("aser_backlog_samples", "Acknowledged samples not yet trained on", registry=self.registry)
        self.model_version = Gauge("aser_model_version", "Version of the weights predictions use",
                                   registry=self.registry)
