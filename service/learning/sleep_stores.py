"""What a sleeping learner keeps on disk beside its checkpoints: the latent store a sleep trains the top from
(`service.storage.latent_store`) and the night's pixel store (`service.storage.pixel_store`). Each is opened once for
the worker's life and brought to every restored checkpoint: a new lineage empties it, a restart drops what came
after the checkpoint, and a file that is damaged, another lineage's (its token is not the checkpoint's) or new beside
a lineage that has learned already is set aside and filled again from the ingest log's retained photos
(docs/operations.md#damaged-files)."""

from __future__ import annotations

import logging
import time

import torch

from learner.methods.base import ContinualLearner
from service.storage.integrity import Damage, sqlite_damage
from service.storage.latent_store import DiskLatentStore, store_capacity
from service.storage.pixel_store import PixelStore
from service.storage.store import IngestLog, LogEntry, images_from_blobs

log = logging.getLogger("aser.worker")

FILLED_AGAIN = "filled again from the ingest log's retained photos"
ANOTHER_LINEAGE = "written by another lineage than the checkpoint's"


class SleepStores:
    """`loop`: the worker's `LoopSpec` (the data directory, ASER_PIXEL_STORE_MB, the seed); `store_mb`: the latent
    store's bound (ASER_SLEEP_STORE_MB)."""

    def __init__(self, loop, store_mb: float, log_store: IngestLog, image_shape: tuple[int, int, int],
                 damage: Damage):
        self.loop, self.store_mb, self.log, self.image_shape, self.damage = loop, store_mb, log_store, image_shape, damage
        self.latents: DiskLatentStore | None = None  # made at the first load of a sleeping learner
        self.pixels: PixelStore | None = None  # the night's photos (with a sleep and ASER_PIXEL_STORE_MB)
        self._latents_damaged = False  # its file was set aside at the first load: filled again after the restore

    def attach(self, learner: ContinualLearner) -> None:
        """Before the restore: a sleeping learner's latents go to the one store on disk."""
        if learner.sleeper is None:
            return
        if self.latents is None:
            path = self.loop.data_dir / "latents.db"
            if reason := sqlite_damage(path):
                self.damage.set_aside(path, reason, "latent_store", FILLED_AGAIN)
                self._latents_damaged = True
            self.latents = self._open_latents(learner)
        learner.sleeper.store = self.latents

    def _open_latents(self, learner: ContinualLearner) -> DiskLatentStore:
        backbone = learner.backbone
        shape, eight_bit = backbone.stored_shape, backbone.stored_dtype == torch.uint8
        return DiskLatentStore(self.loop.data_dir / "latents.db", store_capacity(self.store_mb, shape, eight_bit),
                               shape, eight_bit, backbone.identity(), self.loop.seed)

    def restore(self, learner: ContinualLearner, trained_upto: int, pixel_token: str | None) -> bool:
        """After the restore of a checkpoint at `trained_upto` (which recorded `pixel_token`). Returns whether a
        store was filled again: then a checkpoint should record the new files' tokens."""
        if learner.sleeper is None:
            return False
        return self._restore_latents(learner, trained_upto) | self._restore_pixels(trained_upto, pixel_token)

    def _restore_latents(self, learner: ContinualLearner, trained_upto: int) -> bool:
        fill = bool(trained_upto) and (self._latents_damaged or self.latents.foreign)
        if not trained_upto:  # a new lineage: nothing stored is its own
            self.latents.truncate(0)
        elif fill:
            if self.latents.foreign and not self._latents_damaged:  # the file made for a damaged one is new
                self.latents.close()
                self.damage.set_aside(self.latents.db.path, ANOTHER_LINEAGE, "latent_store", FILLED_AGAIN)
                self.latents = self._open_latents(learner)
                learner.sleeper.store = self.latents
            t0 = time.perf_counter()
            self.latents.truncate(0)
            added = sum(learner.refill_sleep_store(images, torch.tensor([e.class_id for e in entries]),
                                                   torch.tensor([e.seq for e in entries]))
                        for entries, images in self._learned_photos(trained_upto))
            log.info("sleep: the latent store filled again with %d samples in %.1f s", added, time.perf_counter() - t0)
        self._latents_damaged = False
        return fill

    def _restore_pixels(self, trained_upto: int, token: str | None) -> bool:
        if not self.loop.pixel_store_mb:
            return False
        path, fill = self.loop.data_dir / "pixels.db", False
        if self.pixels is None:
            if reason := sqlite_damage(path):
                self.damage.set_aside(path, reason, "pixel_store", FILLED_AGAIN)
            fill = not path.exists()  # damaged, or a data directory made before the store
            self.pixels = self._open_pixels()
            if token is not None and token != self.pixels.token and not fill:
                self.pixels.close()
                self.damage.set_aside(path, ANOTHER_LINEAGE, "pixel_store", FILLED_AGAIN)
                self.pixels, fill = self._open_pixels(), True
        self.pixels.truncate(trained_upto)
        if not (fill and trained_upto):
            return False
        t0 = time.perf_counter()
        for entries, images in self._learned_photos(trained_upto):
            self.keep_pixels(entries, images)
        log.info("the pixel store filled with %d photos from the ingest log in %.1f s", len(self.pixels),
                 time.perf_counter() - t0)
        return True

    def _open_pixels(self) -> PixelStore:
        return PixelStore(self.loop.data_dir / "pixels.db", int(self.loop.pixel_store_mb * 2**20), self.loop.seed)

    def _learned_photos(self, trained_upto: int, chunk: int = 256):
        """The ingest log's samples up to `trained_upto` that still have their pixels, a chunk at a time, decoded."""
        seq = 0
        while entries := [e for e in self.log.after(seq, chunk) if e.seq <= trained_upto]:
            yield entries, images_from_blobs([e.image for e in entries], self.image_shape)
            seq = entries[-1].seq

    def keep_pixels(self, entries: list[LogEntry], images: torch.Tensor | None = None) -> None:
        """The photos of samples just trained or skipped (`images`: decoded already)."""
        if self.pixels is not None and entries:
            if images is None:
                images = images_from_blobs([e.image for e in entries], self.image_shape)
            self.pixels.add([e.seq for e in entries], [e.class_id for e in entries], images)

    def forget_class(self, class_id: int) -> None:
        """The pixel store's part of a forgotten class (the latent store's is the learner's)."""
        if self.pixels is not None:
            self.pixels.forget_class(class_id)

    def close(self) -> None:
        for store in (self.latents, self.pixels):
            if store is not None:
                store.close()
