"""What storage and the learner worker refuse, as domain errors. They know nothing of HTTP;
`service.web.routers.errors` maps each to a status code and the JSON error body."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the domain errors; `code` is the stable machine-readable name."""

    code = "service_error"

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class TooManyClasses(ServiceError):
    code = "too_many_classes"


class SampleIdConflict(ServiceError):
    """A sample id was sent again with another label or image."""

    code = "id_conflict"


class NotFound(ServiceError):
    code = "not_found"


class NoClassesYet(ServiceError):
    """The model has not learned any class, so it can neither predict nor be exported."""

    code = "no_classes"


class SleepOff(ServiceError):
    """A sleep was asked of a service that does not sleep (ASER_SLEEP unset)."""

    code = "sleep_off"


class SnapshotFailed(ServiceError):
    code = "snapshot_failed"


class NoSnapshotYet(ServiceError):
    """An inference replica has not loaded any snapshot yet."""

    code = "no_snapshot"


class IncompatibleCheckpoint(ServiceError):
    """The data directory's checkpoint is of another learner than the settings build (at start-up)."""

    code = "incompatible_checkpoint"


class StorageFull(ServiceError):
    """The disk (or the database's quota) is full: nothing was stored; the same request succeeds
    once space returns."""

    code = "storage_full"


class Unavailable(ServiceError):
    """A dependency of the request is not ready now; retrying later may succeed."""

    code = "unavailable"


class DamagedFile(ServiceError):
    """A file the service wrote does not read back as it was written (cut short, overwritten, another lineage's)."""

    code = "damaged_file"


class DamagedIngestLog(DamagedFile):
    """The ingest log, the record of what was acknowledged, is damaged: the service does not replace it."""

    code = "damaged_ingest_log"
